//! Faults of the bill's machinery, through real sockets: a client that
//! changes its own tools in the middle of a compacted conversation (its
//! prefix is what counts: the proxy's tool stays after the client's, the
//! same bytes, and the cache holds what the client kept), and a wall clock
//! that moved backwards under the records (a restart reading times from
//! the store that are later than now).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/agent_loop.rs"]
mod agent_loop;

use std::time::{Duration, Instant};

use agent_loop::{Loop, Shape};
use compactor::compaction::recall::TOOL;
use compactor::fake_upstream::Reply;
use serde_json::{json, Value};
use support::{
    compactions, filler, post_messages, small_window, wait_compactions, within, Harness,
};

const DAY_MS: i64 = 86_400_000;

/// One chat turn of the conversation the client names `key` (see
/// [`support::chat_turn`]).
async fn chat_turn(
    h: &Harness,
    key: &str,
    history: &mut Vec<Value>,
    text: String,
) -> (String, bool) {
    let url = format!("{}/chat/completions", h.url());
    support::chat_turn(
        &url,
        "sk-clock-back-0001",
        Some(key),
        "tiny-clock",
        history,
        text,
    )
    .await
}

/// Stops the proxy, moves every time its store holds a day ahead (the
/// records of a clock that has since been set back a day), and starts it
/// again on that store.
async fn restart_a_day_behind(h: Harness) -> Harness {
    h.restart_with(|db, _| {
        let conn = rusqlite::Connection::open(db).unwrap();
        conn.execute("UPDATE compactions SET created_ms = created_ms + ?1", [DAY_MS])
            .unwrap();
        for sql in [
            "UPDATE exchanges SET started_ms = started_ms + ?1",
            "UPDATE conversations SET created_ms = created_ms + ?1, last_seen_ms = last_seen_ms + ?1",
        ] {
            assert!(conn.execute(sql, [DAY_MS]).unwrap() > 0, "{sql}");
        }
    })
    .await
}

/// A compaction stored under a clock a day ahead, read back after a
/// restart, is not taken as one stored after every request of the next
/// day: a request of its conversation that it does not cover and that
/// crosses the trigger gets its compaction computed. (Taken as newer than
/// the request, its savings were subtracted from the request's usage, and
/// the conversation went on uncompacted to the hard limit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_stamped_in_the_future_does_not_hold_the_next_one_back() {
    if support::sqlite_only("edits the harness's SQLite file between two runs") {
        return;
    }
    let h = Harness::start_with(small_window).await;
    let key = "clock-back-compacted";
    let mut history = vec![json!({"role": "system", "content": "Agent."})];
    let mut compacted = false;
    for i in 0..40 {
        (_, compacted) = chat_turn(&h, key, &mut history, filler(i)).await;
        if compacted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(compacted, "compacted before the restart");
    let h = restart_a_day_behind(h).await;
    let before = compactions(&h);
    // The client compacted by itself meanwhile: its new history starts
    // from its own summary, which the stored compaction does not cover,
    // and crosses the trigger again.
    let mut history = vec![
        json!({"role": "system", "content": "Agent."}),
        json!({"role": "user", "content": "Summary of the earlier steps: modules 0 to 9 explained."}),
        json!({"role": "assistant", "content": "Going on."}),
    ];
    for i in 0..5 {
        history.push(json!({"role": "user", "content": filler(100 + i)}));
        history.push(
            json!({"role": "assistant", "content": format!("Module {} explained.", 100 + i)}),
        );
    }
    let trigger = 2025;
    h.fake
        .push(Reply::chat("Module 105 next.", trigger + 200, 9));
    let (_, compacted) = chat_turn(&h, key, &mut history, filler(105)).await;
    assert!(!compacted, "the stored compaction does not cover it");
    wait_compactions(&h, before + 1).await;
}

/// A conversation past the cold threshold whose records a restart reads
/// stamped a day ahead waits its idle time as the process measures it:
/// no compaction right away (an idle time taken from the store's stamps
/// would be negative, or, wrapped around, huge), one once it has been
/// idle for most of the cache's lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_conversation_stamped_in_the_future_waits_its_time() {
    if support::sqlite_only("edits the harness's SQLite file between two runs") {
        return;
    }
    const TTL: Duration = Duration::from_secs(2);
    // A 6000-token window: the trigger at 4350, the cold threshold at 1450.
    let h = Harness::start_with(|c| {
        c.models.push(compactor::config::ModelConfig {
            pattern: "loop-*".into(),
            context_window: 6000,
            max_output_tokens: Some(200),
            ..Default::default()
        });
        c.compaction.cache_ttl_secs = TTL.as_secs_f64();
        c.compaction.cold_ratio = 0.25;
    })
    .await;
    let mut l = Loop::new(
        Shape::Chat,
        "loop-clock",
        "sk-clock-idle-000000001",
        5,
        1900,
    );
    assert!((1800..4000).contains(&l.prompt_tokens()));
    l.step(&h, l.shell_reply()).await;
    let h = restart_a_day_behind(h).await;
    assert_eq!(compactions(&h), 0);
    l.round(300);
    l.step(&h, l.shell_reply()).await;
    let answered = Instant::now();
    tokio::time::sleep(TTL / 2).await;
    assert_eq!(compactions(&h), 0, "nothing before it is idle");
    wait_compactions(&h, 1).await;
    assert!(answered.elapsed() >= TTL.mul_f64(0.8));
    let reasons: Vec<String> = support::column(&*h.sql(), "SELECT reason FROM compactions");
    assert!(reasons[0].starts_with("cold:"), "{reasons:?}");
}

const SONNET: &str = "claude-sonnet-4-5-20250929";

/// A client tool of Messages' shape, its description long enough that the
/// tools alone are a cacheable prefix (Claude Code's are ~18k tokens).
fn messages_tool(name: &str, what: &str) -> Value {
    json!({"name": name, "description": format!("{what} {}", "Mind the sandbox rules. ".repeat(120)),
           "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}}})
}

/// `tools` with Claude Code's breakpoint on the last.
fn with_breakpoint(mut tools: Vec<Value>) -> Vec<Value> {
    tools.last_mut().unwrap()["cache_control"] = json!({"type": "ephemeral"});
    tools
}

/// One turn of the Messages session under `tools`: the conversation, the
/// upstream's request (the client's, not a summary call) and what the
/// simulated cache billed for it.
async fn messages_turn(
    h: &Harness,
    history: &mut Vec<Value>,
    tools: &[Value],
    i: usize,
) -> (String, bool, Value, compactor::fake_upstream::cache::Usage) {
    let system = json!([{"type": "text", "text": "You are a careful agent. ".repeat(200),
                         "cache_control": {"type": "ephemeral"}}]);
    let text = [filler(i), filler(i + 100), filler(i + 200)].join("\n");
    history.push(json!({"role": "user", "content": [{"type": "text", "text": text}]}));
    let mut messages = history.clone();
    messages.last_mut().unwrap()["content"][0]["cache_control"] = json!({"type": "ephemeral"});
    // Its session id, as Claude Code sends it: the breakpoint it moves
    // every request changes the bytes of its last items, which alone would
    // not name the conversation.
    let meta = json!({"user_id": "{\"device_id\": \"d\", \"session_id\": \"7d1e0c2a-tools\"}"});
    let body = json!({"model": SONNET, "max_tokens": 200, "system": system, "tools": tools,
                      "messages": messages, "metadata": meta});
    h.fake.take_bill();
    let resp = post_messages(h, "sk-ant-tools-change-0001", "", &body).await;
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    let answer: Value = within(resp.json()).await.unwrap();
    history.push(json!({"role": "assistant", "content": answer["content"]}));
    let sent = last_from_client(h).json();
    let billed: Vec<_> = h
        .fake
        .take_bill()
        .into_iter()
        .filter(|b| !b.summarizer)
        .collect();
    assert_eq!(billed.len(), 1, "{billed:?}");
    let id = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    (
        id,
        headers.contains_key("x-compactor-compacted"),
        sent,
        billed[0].usage,
    )
}

/// The last request the upstream got that was not a summary call.
fn last_from_client(h: &Harness) -> compactor::fake_upstream::Received {
    let received = h.fake.received();
    received
        .into_iter()
        .rev()
        .find(|r| !support::is_summary_call(r))
        .unwrap()
}

/// The breakpoints of the last request the upstream got from the client.
fn breakpoints_sent(h: &Harness) -> usize {
    let sent = last_from_client(h);
    String::from_utf8_lossy(&sent.body)
        .matches("\"cache_control\"")
        .count()
}

/// The upstream's tools: the client's, as it sent them, then the proxy's
/// recall tool, whose definition is returned.
fn clients_then_recall(sent: &Value, tools: &[Value]) -> Value {
    let got = sent["tools"].as_array().unwrap();
    assert_eq!(
        &got[..tools.len()],
        tools,
        "the client's tools, as it sent them, first"
    );
    assert_eq!(got.len(), tools.len() + 1, "{got:?}");
    assert_eq!(got[tools.len()]["name"], TOOL);
    got[tools.len()].clone()
}

/// A client that edits, adds and removes its own tools after the proxy
/// compacted (Claude Code loading an MCP server, a skill): the
/// conversation stays the same and compacted, every request succeeds, the
/// upstream gets the client's tools as sent and the recall tool after
/// them with the same bytes each time. What the simulated Anthropic cache
/// bills shows the prefix is the client's: the edit of its first tool
/// reads nothing (the client changed the first block), the next request
/// reads again, a tool appended after the breakpoint keeps the tools
/// before it cached, and going back to the earlier tools reads the
/// longer prefix written under them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_changes_its_tools_keeps_its_conversation_and_its_prefix() {
    let h = Harness::start_with(|c| {
        c.models.push(compactor::config::ModelConfig {
            pattern: "claude-sonnet-4-5*".into(),
            context_window: 16000,
            max_output_tokens: Some(1024),
            ..Default::default()
        });
    })
    .await;
    h.fake
        .simulate_cache(compactor::fake_upstream::cache::Settings::default());
    let tools = with_breakpoint(vec![
        messages_tool("Bash", "Runs a shell command."),
        messages_tool("Read", "Reads a file."),
    ]);
    let mut history: Vec<Value> = vec![];
    let mut turn = 0;
    let conversation = loop {
        let (id, compacted, _, _) = messages_turn(&h, &mut history, &tools, turn).await;
        turn += 1;
        if compacted {
            break id;
        }
        assert!(turn < 40, "compacted within 40 turns");
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    let (_, _, sent, _) = messages_turn(&h, &mut history, &tools, turn).await;
    let recall = clients_then_recall(&sent, &tools);
    let mut step = |changed: &[Value]| {
        turn += 1;
        (changed.to_vec(), turn)
    };
    let go = async |h: &Harness, history: &mut Vec<Value>, (tools, turn): (Vec<Value>, usize)| {
        let (id, compacted, sent, usage) = messages_turn(h, history, &tools, turn).await;
        assert_eq!(id, conversation, "the same conversation");
        assert!(compacted, "still compacted");
        assert_eq!(
            clients_then_recall(&sent, &tools),
            recall,
            "the recall tool's bytes"
        );
        usage
    };
    // The first tool's description edited: the client's first block
    // changed, nothing of the prefix is read.
    let mut edited = tools.clone();
    edited[0]["description"] = json!(format!(
        "Runs a command in bash. {}",
        "Mind the sandbox rules. ".repeat(120)
    ));
    let usage = go(&h, &mut history, step(&edited)).await;
    assert_eq!(usage.read, 0, "{usage:?}");
    // The same tools again: read from the cache.
    let usage = go(&h, &mut history, step(&edited)).await;
    assert!(usage.read > 0, "{usage:?}");
    let whole = usage.read;
    // Three breakpoints of the client's, and the proxy's after the
    // compacted prefix.
    assert_eq!(breakpoints_sent(&h), 4);
    // A tool added after the breakpoint, with one of its own: the tools
    // before it stay cached, and with the client's four breakpoints the
    // proxy's own goes (the API takes four).
    let mut added = edited.clone();
    added.push(messages_tool("Grep", "Searches files."));
    added[2]["cache_control"] = json!({"type": "ephemeral"});
    let usage = go(&h, &mut history, step(&added)).await;
    assert!(
        usage.read > 0 && usage.read < whole,
        "{usage:?} against {whole}"
    );
    assert_eq!(breakpoints_sent(&h), 4, "the client's four");
    // Removed again: the longer prefix written under the edited tools.
    let usage = go(&h, &mut history, step(&edited)).await;
    assert!(usage.read >= whole, "{usage:?} against {whole}");
}
