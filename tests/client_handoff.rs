//! After a client's own compaction, on real sockets: Claude Code (and
//! Codex) go on from their own summary; what that summary left out of the
//! trail — the user's rule, the file written, the command with its exit
//! status — the upstream still gets, appended once to the summary's
//! message, the same bytes on every later request (so its cache holds).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::fake_upstream::Received;
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-ant-test-handoff-0001";
const SESSION: &str = "5a1b2c3d-0000-4000-8000-00000000abcd";

fn body(messages: &[Value]) -> Value {
    let meta =
        json!({"user_id": format!("{{\"device_id\": \"d\", \"session_id\": \"{SESSION}\"}}")});
    json!({"model": "claude-x", "max_tokens": 200, "metadata": meta, "messages": messages})
}

/// A session with a rule, a file written and a failing command.
fn history() -> Vec<Value> {
    vec![
        json!({"role": "user", "content": "Fix the build in ./svc."}),
        json!({"role": "assistant", "content": "Looking at the port first."}),
        json!({"role": "user", "content": "From now on, never push to main."}),
        json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Write",
             "input": {"file_path": "svc/port.rs", "content": "pub const PORT: u16 = 8123;\n"}}]}),
        json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "File created successfully"}]}),
        json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "cargo test -p svc"}}]}),
        json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
             "content": "Exit code 101\nerror[E0425]: cannot find value `PORT` in this scope"}]}),
    ]
}

const HANDOFF: &str = "This session is being continued from a previous conversation that ran out \
    of context. The summary below covers the earlier portion of the conversation.\n\nThe user \
    asked to fix the build; work is under way.";

async fn send(h: &Harness, messages: &[Value]) {
    let resp = post_messages(h, KEY, "", &body(messages)).await;
    assert_eq!(resp.status(), 200);
    within(resp.bytes()).await.unwrap();
}

/// A turn of the session, then Claude Code's own compaction of it: the
/// history and its instruction.
async fn compacts_by_itself(h: &Harness) {
    send(h, &history()).await;
    let mut ask = history();
    ask.push(json!({"role": "user", "content":
        "Your task is to create a detailed summary of the conversation so far."}));
    send(h, &ask).await;
}

/// The text of the first message of the upstream's request.
fn first_message(r: &Received) -> Value {
    r.json()["messages"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_clients_summary_left_out_follows_it() {
    let h = Harness::start().await;
    compacts_by_itself(&h).await;
    // It goes on from its summary, twice.
    let mut next = vec![
        json!({"role": "user", "content": HANDOFF}),
        json!({"role": "user", "content": "Go on."}),
    ];
    send(&h, &next).await;
    next.push(json!({"role": "assistant", "content": "Running the tests again."}));
    next.push(json!({"role": "user", "content": "And then?"}));
    send(&h, &next).await;
    let got: Vec<Received> = h
        .fake
        .received()
        .into_iter()
        .filter(|r| r.path.ends_with("/messages"))
        .collect();
    assert_eq!(got.len(), 4);
    let first = first_message(&got[2]);
    let text = serde_json::to_string(&first).unwrap();
    for fact in [
        "never push to main",
        "svc/port.rs",
        "cargo test -p svc",
        "Exit code 101",
    ] {
        assert!(text.contains(fact), "{fact} in {text}");
    }
    assert!(text.starts_with(&serde_json::to_string(&json!({"role": "user"})).unwrap()[..8]));
    assert_eq!(
        first_message(&got[3]),
        first,
        "every later request carries the same bytes"
    );
    // What the client sent after the summary goes as it came.
    assert_eq!(
        got[3].json()["messages"][1],
        json!({"role": "user", "content": "Go on."})
    );
    assert_eq!(got[3].json()["messages"].as_array().unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_that_states_the_whole_trail_goes_as_it_came() {
    let h = Harness::start().await;
    compacts_by_itself(&h).await;
    let full = format!(
        "{HANDOFF} The user said: From now on, never push to main. Wrote svc/port.rs. \
         Ran cargo test -p svc: Exit code 101."
    );
    let next = vec![
        json!({"role": "user", "content": full}),
        json!({"role": "user", "content": "Go on."}),
    ];
    send(&h, &next).await;
    let last = h.fake.received().pop().unwrap();
    assert_eq!(last.json()["messages"], json!(next));
}

/// Codex: its compaction request says so in `x-codex-turn-metadata`; the
/// next window holds the user messages it kept and its summary message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codexs_summary_gets_what_it_left_out() {
    let h = Harness::start().await;
    let user = |t: &str| {
        json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": t}]})
    };
    let history = vec![
        user("Fix the build in ./svc."),
        user("From now on, never push to main."),
        json!({"type": "function_call", "call_id": "c1", "name": "shell",
            "arguments": "{\"command\":[\"bash\",\"-lc\",\"cargo test -p svc\"]}"}),
        json!({"type": "function_call_output", "call_id": "c1",
            "output": "Exit code: 101\nWall time: 1.2 seconds\nOutput:\nerror[E0425]: cannot find value `PORT`"}),
    ];
    let post = |input: Vec<Value>, compaction: bool| {
        let h = &h;
        async move {
            let mut req = client()
                .post(format!("{}/responses", h.url()))
                .header("authorization", "Bearer sk-codex-handoff-0001")
                .json(&json!({"model": "gpt-x", "prompt_cache_key": SESSION, "input": input}));
            if compaction {
                req = req.header("x-codex-turn-metadata", r#"{"request_kind":"compaction"}"#);
            }
            let resp = within(req.send()).await.unwrap();
            assert_eq!(resp.status(), 200);
            within(resp.bytes()).await.unwrap();
        }
    };
    post(history.clone(), false).await;
    let mut ask = history.clone();
    ask.push(user(
        "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary.",
    ));
    post(ask, true).await;
    let next = vec![
        user("Fix the build in ./svc."),
        user(
            "Another language model started to solve this problem and produced a summary of \
              its thinking process. The build is being fixed.",
        ),
        user("Go on."),
    ];
    post(next.clone(), false).await;
    let last = h.fake.received().pop().unwrap().json();
    let text = serde_json::to_string(&last["input"][1]).unwrap();
    for fact in ["never push to main", "cargo test -p svc", "Exit code: 101"] {
        assert!(text.contains(fact), "{fact} in {text}");
    }
    assert_eq!(last["input"][0], next[0]);
    assert_eq!(last["input"][2], next[2]);
}
