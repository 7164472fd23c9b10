//! Compaction the model asks for, through real sockets: with
//! `compaction.agent_tool` on, a request with tools of its own is offered
//! `compactor_compact`; the proxy answers a call of it itself, sends the
//! continued request, and the client gets the final answer alone (JSON and
//! SSE; Chat Completions, Responses and Anthropic Messages). The compaction
//! is computed in the background and applied at the next turn boundary,
//! with the model's `keep` notes in its summary. One call per turn; manual
//! mode; a client tool of the same name wins.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/agent_loop.rs"]
mod agent_loop;

use agent_loop::{agent_on, Loop, Shape, SHAPES};
use compactor::compaction::agent_tool::{ALREADY_SCHEDULED, KEEP_HEADING, SCHEDULED, TOOL};
use compactor::config::Mode;
use serde_json::json;
use std::time::Duration;
use support::{column, compactions, wait_compactions, Harness};

const MODEL: &str = "agent-test";
const NOTE: &str = "KEEP: the service listens on port 8123; run the tests with --release";

fn compacted(headers: &http::HeaderMap) -> bool {
    headers.get("x-compactor-compacted").is_some()
}

/// A conversation of about 2900 tokens: below the trigger, with older
/// tool outputs a summary can replace.
fn conversation(shape: Shape, key: &str) -> Loop {
    Loop::new(shape, MODEL, key, 6, 1900)
}

fn compact_args() -> serde_json::Value {
    json!({"reason": "the context is filling up with build logs", "keep": NOTE})
}

async fn send_ok(h: &Harness, l: &Loop) -> (http::HeaderMap, String) {
    let (status, headers, body) = l.send(h).await;
    let text = String::from_utf8_lossy(&body).to_string();
    assert_eq!(status, 200, "{text}");
    (headers, text)
}

async fn the_call_is_answered_and_compacts_at_the_next_boundary(shape: Shape, stream: bool) {
    let h = Harness::start_with(agent_on).await;
    let mut l = conversation(shape, &format!("sk-agent-{shape:?}-{stream}-0001"));
    l.stream = stream;
    // The model asks for a compaction, then carries on with its own tool.
    h.fake
        .push(l.call_reply("call_compact", TOOL, compact_args(), l.prompt_tokens()));
    h.fake.push(l.shell_reply());
    let (headers, text) = send_ok(&h, &l).await;
    let what = format!("{shape:?}, stream {stream}");
    assert!(
        !compacted(&headers),
        "{what}: the asking request is not cut"
    );
    assert!(
        !text.contains(TOOL) && !text.contains("call_compact"),
        "{what}: the client never sees the call: {text}"
    );
    assert!(
        text.contains(&l.call_id()),
        "{what}: its own call relayed: {text}"
    );
    let upstream = l.upstream(&h);
    assert_eq!(
        upstream.len(),
        2,
        "{what}: the request, then its continuation"
    );
    assert_eq!(
        l.tool_names(&upstream[0]),
        ["shell", TOOL],
        "{what}: offered after the client's tools"
    );
    let cont = String::from_utf8_lossy(&upstream[1].body).to_string();
    assert!(
        cont.contains(SCHEDULED),
        "{what}: answered by the proxy: {cont}"
    );
    // Computed in the background, with the model's notes in its summary.
    wait_compactions(&h, 1).await;
    let summary: Vec<Option<String>> = column(&*h.sql(), "SELECT summary FROM compactions");
    let summary = summary[0].clone().unwrap_or_default();
    assert!(
        summary.contains(KEEP_HEADING) && summary.contains(NOTE),
        "{what}: {summary}"
    );
    let reason: Vec<String> = column(&*h.sql(), "SELECT reason FROM compactions");
    assert!(
        reason[0].starts_with("agent: the context is filling up"),
        "{}",
        reason[0]
    );
    // The rest of the turn goes without it.
    l.round(300);
    h.fake.push(l.text_reply("The tests pass."));
    let (headers, _) = send_ok(&h, &l).await;
    assert!(!compacted(&headers), "{what}: not before the boundary");
    // The next user message: compacted, the notes in what the model reads.
    l.assistant("The tests pass.");
    l.user("Now document the port.");
    l.reported = Some(1500);
    h.fake.push(l.text_reply("Documented."));
    let (headers, _) = send_ok(&h, &l).await;
    assert!(compacted(&headers), "{what}: compacted at the boundary");
    let last = l.upstream(&h).pop().unwrap();
    assert!(String::from_utf8_lossy(&last.body).contains("service listens on port 8123"));
    let m = &h.state.metrics;
    assert_eq!(
        (
            m.triggers("agent"),
            m.triggers("boundary"),
            m.triggers("threshold")
        ),
        (1, 1, 0),
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_the_call_is_answered_and_compacts_at_the_next_boundary() {
    for stream in [false, true] {
        the_call_is_answered_and_compacts_at_the_next_boundary(Shape::Chat, stream).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_the_call_is_answered_and_compacts_at_the_next_boundary() {
    for stream in [false, true] {
        the_call_is_answered_and_compacts_at_the_next_boundary(Shape::Responses, stream).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_the_call_is_answered_and_compacts_at_the_next_boundary() {
    for stream in [false, true] {
        the_call_is_answered_and_compacts_at_the_next_boundary(Shape::Messages, stream).await;
    }
}

/// A second call in the same turn — in the same request or a later one of
/// the loop — is told the compaction is already scheduled, and schedules
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_call_in_the_same_turn_is_told_it_is_already_scheduled() {
    let h = Harness::start_with(agent_on).await;
    let mut l = conversation(Shape::Chat, "sk-agent-twice-000001");
    let p = l.prompt_tokens();
    h.fake
        .push(l.call_reply("call_c1", TOOL, compact_args(), p));
    h.fake
        .push(l.call_reply("call_c2", TOOL, compact_args(), p));
    h.fake.push(l.shell_reply());
    let (_, text) = send_ok(&h, &l).await;
    assert!(!text.contains(TOOL), "{text}");
    let upstream = l.upstream(&h);
    assert_eq!(upstream.len(), 3);
    let last = l.items_of(&upstream[2]);
    let answers: Vec<&str> = last
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str())
        .filter(|c| c.contains("scheduled"))
        .collect();
    assert_eq!(answers, [SCHEDULED, ALREADY_SCHEDULED]);
    // Later in the same tool loop.
    wait_compactions(&h, 1).await;
    l.round(300);
    h.fake
        .push(l.call_reply("call_c3", TOOL, compact_args(), p));
    h.fake.push(l.text_reply("Done."));
    let (_, text) = send_ok(&h, &l).await;
    assert!(!text.contains(TOOL), "{text}");
    let last = l.upstream(&h).pop().unwrap();
    let tail = l.items_of(&last).pop().unwrap();
    assert_eq!(tail["content"], ALREADY_SCHEDULED, "{tail}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(compactions(&h), 1, "one compaction for the turn");
    assert_eq!(h.state.metrics.triggers("agent"), 1);
}

/// In manual mode nothing compacts on its own, past the threshold too;
/// the model's call does, at the next boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_mode_compacts_when_the_model_asks() {
    let h = Harness::start_with(|c| {
        agent_on(c);
        c.compaction.mode = Mode::Manual;
    })
    .await;
    // Past the trigger (about 4800 tokens).
    let mut l = Loop::new(Shape::Messages, MODEL, "sk-agent-manual-0001", 10, 1900);
    h.fake.push(l.shell_reply());
    send_ok(&h, &l).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(compactions(&h), 0, "no threshold compaction in manual mode");
    l.round(300);
    h.fake
        .push(l.call_reply("call_m", TOOL, compact_args(), l.prompt_tokens()));
    h.fake.push(l.text_reply("Carrying on."));
    let (_, text) = send_ok(&h, &l).await;
    assert!(!text.contains(TOOL), "{text}");
    wait_compactions(&h, 1).await;
    l.assistant("Carrying on.");
    l.user("Next step.");
    h.fake.push(l.text_reply("Next."));
    let (headers, _) = send_ok(&h, &l).await;
    assert!(
        compacted(&headers),
        "the model's compaction applies at the boundary"
    );
    let m = &h.state.metrics;
    assert_eq!((m.triggers("agent"), m.triggers("threshold")), (1, 0));
}

/// A client that declares its own `compactor_compact` gets its calls; the
/// proxy offers nothing over it, schedules nothing. With the setting off,
/// or `n` > 1, nothing is offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_tool_of_the_same_name_wins() {
    for shape in SHAPES {
        let h = Harness::start_with(agent_on).await;
        let mut l = conversation(shape, &format!("sk-agent-own-{shape:?}-01"));
        let own = l.tool_def(TOOL);
        l.tools = json!([l.tool_def("shell"), own]);
        h.fake
            .push(l.call_reply("call_own", TOOL, compact_args(), l.prompt_tokens()));
        let (_, text) = send_ok(&h, &l).await;
        assert!(
            text.contains("call_own"),
            "{shape:?}: the client's call relayed: {text}"
        );
        let upstream = l.upstream(&h);
        assert_eq!(upstream.len(), 1, "{shape:?}: no hidden round");
        assert_eq!(l.tool_names(&upstream[0]), ["shell", TOOL]);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(compactions(&h), 0, "{shape:?}");
    }
    // Off by default; never with several choices.
    let h = Harness::start_with(|c| {
        agent_on(c);
        c.compaction.agent_tool = false;
    })
    .await;
    let l = conversation(Shape::Chat, "sk-agent-off-000001");
    h.fake.push(l.text_reply("ok"));
    send_ok(&h, &l).await;
    let sent = l.upstream(&h).pop().unwrap();
    assert_eq!(l.tool_names(&sent), ["shell"]);
    assert_eq!(sent.body, serde_json::to_vec(&l.body()).unwrap(), "as sent");
    let h = Harness::start_with(agent_on).await;
    let l = conversation(Shape::Chat, "sk-agent-n2-0000001");
    let mut body = l.body();
    body["n"] = json!(2);
    h.fake.push(l.text_reply("ok"));
    let (status, _, _) =
        support::post(&format!("{}/chat/completions", h.url()), &l.key, &body).await;
    assert_eq!(status, 200);
    assert_eq!(l.tool_names(&l.upstream(&h).pop().unwrap()), ["shell"]);
}

/// Anthropic Messages with thinking on: the hidden round replays the
/// model's signed thinking as it came, and the client's later requests,
/// which lack the hidden round, are still accepted (the fake refuses a
/// thinking block whose prefix changed, as the API documents).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_thinking_on_the_hidden_round_and_the_requests_after_it_are_accepted() {
    use compactor::fake_upstream::anthropic::Answer;
    use compactor::fake_upstream::Reply;
    let h = Harness::start_with(agent_on).await;
    for stream in [false, true] {
        let mut l = conversation(Shape::Messages, &format!("sk-agent-think-{stream}-01"));
        l.stream = stream;
        // Its tool calls were made without thinking: a new turn starts.
        l.assistant("Built.");
        l.user("Now run the tests.");
        h.fake.push(Reply::Messages(
            Answer::tool_use("call_think", TOOL, compact_args())
                .thinking("the logs crowd the context"),
        ));
        h.fake.push(Reply::Messages(
            Answer::tool_use(&l.call_id(), "shell", json!({"cmd": "cargo test"}))
                .thinking("run the tests again"),
        ));
        let (status, text) = send_thinking(&h, &l).await;
        assert_eq!(status, 200, "stream {stream}: {text}");
        assert!(!text.contains(TOOL), "{text}");
        // The client goes on from what it saw: the answer's thinking and
        // its own tool call, then the tool's output.
        let answer = if stream {
            let mut c = compactor::wire::messages::MessagesCollector::default();
            for event in text.split("\n\n") {
                let (mut name, mut data) = ("", String::new());
                for line in event.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n;
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data.push_str(d);
                    }
                }
                if !data.is_empty() {
                    c.push(name, &data);
                }
            }
            c.items().remove(0)
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            json!({"role": "assistant", "content": v["content"]})
        };
        l.items.push(answer);
        l.items.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": l.call_id(), "content": "test result: ok"}]}));
        h.fake
            .push(Reply::Messages(Answer::text("All green.").thinking("done")));
        let (status, text) = send_thinking(&h, &l).await;
        assert_eq!(
            status, 200,
            "stream {stream}: the next request is accepted: {text}"
        );
    }
}

/// Sends the loop's Messages request with thinking on: status and body.
async fn send_thinking(h: &Harness, l: &Loop) -> (u16, String) {
    let mut body = l.body();
    body["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    body["max_tokens"] = json!(2048);
    let resp = support::within(
        support::client()
            .post(format!("http://{}/v1/messages", h.addr))
            .header("x-api-key", &l.key)
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send(),
    )
    .await
    .unwrap();
    let status = resp.status().as_u16();
    let text = support::within(resp.text()).await.unwrap();
    (status, text)
}
