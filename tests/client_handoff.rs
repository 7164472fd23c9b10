//! After a client's own compaction, on real sockets: Claude Code (and
//! Codex) go on from their own summary; what that summary left out of the
//! trail — the user's rule, the file written, the command with its exit
//! status — the upstream still gets, appended once to the summary's
//! message, the same bytes on every later request (so its cache holds).
//! When the client compacts again, from a history that opens with its own
//! summary, its compaction request carries that block too, and what its
//! next summary leaves out of the whole trail follows it; so does the
//! trail a first summary stated whole, which got no block.
//!
//! A client that keeps compacting: its own compaction request sent again
//! over the same history, or again within a few requests of the last one,
//! is forwarded as it came (never failed nor answered by the proxy),
//! counted (`compactor_client_compaction_repeats_total`), logged, shown in
//! the admin API's savings report beside the proxy's own storms avoided,
//! and the proxy backs off its part of the restart: no trail appended
//! after a repeat. A failed compaction request sent again is a retry, not
//! a repeat; one that comes after the conversation went on for a while is
//! a new compaction.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::fake_upstream::{Received, Reply};
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
    let repeats = || h.state.metrics.storms().client_compaction_repeats();
    assert_eq!(repeats(), 0, "a first compaction is no repeat");
    // Codex compacts its new window at once: a repeat, forwarded as it came.
    let mut again = next.clone();
    again.push(user(
        "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary.",
    ));
    post(again.clone(), true).await;
    assert_eq!(repeats(), 1);
    assert_eq!(
        h.fake.received().pop().unwrap().json()["input"],
        json!(again)
    );
}

/// `messages` with Claude Code's summary instruction after them.
fn compaction_request(messages: &[Value]) -> Vec<Value> {
    let mut ask = messages.to_vec();
    ask.push(json!({"role": "user", "content":
        "Your task is to create a detailed summary of the conversation so far."}));
    ask
}

/// The first messages of a window that goes on from the client's
/// summary (each summary its own: `n`).
fn restart(n: usize) -> Vec<Value> {
    let summary = format!(
        "This session is being continued from a previous conversation that ran out of \
         context. The summary below covers the earlier portion of the conversation.\n\n\
         The user asked to fix the build; work is under way (summary {n})."
    );
    vec![
        json!({"role": "user", "content": summary}),
        json!({"role": "user", "content": "Go on."}),
    ]
}

/// Sends `messages` under `key`: the status.
async fn status_of(h: &Harness, key: &str, messages: &[Value]) -> u16 {
    let resp = post_messages(h, key, "", &body(messages)).await;
    let status = resp.status().as_u16();
    within(resp.bytes()).await.unwrap();
    status
}

fn received_messages(h: &Harness) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path.ends_with("/messages"))
        .collect()
}

/// Whether the upstream got the proxy's trail in the last request's first
/// message (the client's own summary carries none of it).
fn trail_appended(h: &Harness) -> bool {
    let last = received_messages(h).pop().unwrap().json();
    last["messages"][0]
        .to_string()
        .contains("never push to main")
}

async fn repeats(h: &Harness) -> (u64, Value) {
    let report = h.get_json("/admin/api/savings").await;
    (
        h.state.metrics.storms().client_compaction_repeats(),
        report["storms"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_compaction_request_again_is_forwarded_counted_and_gets_no_trail() {
    let h = Harness::start().await;
    let logs = captured_logs();
    let key = "sk-ant-storm-same-0001";
    assert_eq!(status_of(&h, key, &history()).await, 200);
    let ask = compaction_request(&history());
    assert_eq!(status_of(&h, key, &ask).await, 200);
    assert_eq!(repeats(&h).await.0, 0, "a first compaction is no repeat");
    // The client asks for the same summary again: it goes upstream as it
    // came, and is answered.
    assert_eq!(status_of(&h, key, &ask).await, 200);
    let got = received_messages(&h);
    assert_eq!(got.len(), 3);
    assert_eq!(
        got[2].json()["messages"],
        json!(ask),
        "forwarded as it came"
    );
    let (count, storms) = repeats(&h).await;
    assert_eq!(count, 1);
    assert_eq!(storms, json!({"proxy_avoided": 0, "client_repeats": 1}));
    let scraped = h.scrape().await;
    assert!(
        scraped.contains("compactor_client_compaction_repeats_total 1"),
        "{scraped}"
    );
    let logs = captured_logs()[logs.len()..].to_string();
    assert!(
        logs.contains("the client compacts again before its last compaction bought any turns")
            && logs.contains("same_history=true"),
        "{logs}"
    );
    // The proxy backs off its part: the restart goes as the client made it.
    assert_eq!(status_of(&h, key, &restart(1)).await, 200);
    assert!(!trail_appended(&h), "no trail after a repeat");
    let last = received_messages(&h).pop().unwrap().json();
    assert_eq!(last["messages"], json!(restart(1)));
}

/// The session under `key`, Claude Code's compaction of it, and the first
/// request that goes on from its summary, which gets the trail the
/// summary left out: that request's messages.
async fn first_restart(h: &Harness, key: &str) -> Vec<Value> {
    assert_eq!(status_of(h, key, &history()).await, 200);
    assert_eq!(
        status_of(h, key, &compaction_request(&history())).await,
        200
    );
    let window = restart(1);
    assert_eq!(status_of(h, key, &window).await, 200);
    assert!(trail_appended(h), "the trail after a first compaction");
    window
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_soon_after_the_last_is_a_repeat_and_a_later_one_is_not() {
    let h = Harness::start().await;
    let key = "sk-ant-storm-soon-0001";
    let mut window = first_restart(&h, key).await;
    // One more request, and the client compacts its new window already.
    window.push(json!({"role": "assistant", "content": "Running the tests again."}));
    window.push(json!({"role": "user", "content": "And then?"}));
    assert_eq!(status_of(&h, key, &window).await, 200);
    assert_eq!(status_of(&h, key, &compaction_request(&window)).await, 200);
    assert_eq!(repeats(&h).await.0, 1, "compacted again two requests on");
    assert_eq!(status_of(&h, key, &restart(2)).await, 200);
    assert!(!trail_appended(&h), "no trail after a repeat");
    // A window that bought turns: its compaction is a new one.
    let mut window = restart(3);
    for i in 0..=compactor::engine::FEW_REQUESTS {
        window.push(json!({"role": "assistant", "content": format!("Step {i} done.")}));
        window.push(json!({"role": "user", "content": format!("Next, step {}.", i + 1)}));
        assert_eq!(status_of(&h, key, &window).await, 200);
    }
    assert_eq!(status_of(&h, key, &compaction_request(&window)).await, 200);
    assert_eq!(repeats(&h).await.0, 1, "not a repeat");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_compaction_request_sent_again_is_a_retry() {
    let h = Harness::start().await;
    let key = "sk-ant-storm-retry-0001";
    assert_eq!(status_of(&h, key, &history()).await, 200);
    let ask = compaction_request(&history());
    h.fake.push(Reply::json(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ));
    assert_eq!(status_of(&h, key, &ask).await, 529);
    assert_eq!(status_of(&h, key, &ask).await, 200);
    assert_eq!(repeats(&h).await.0, 0, "a retry of a failed request");
    // Its trail still follows the summary.
    assert_eq!(status_of(&h, key, &restart(1)).await, 200);
    assert!(trail_appended(&h));
}

/// A window that goes on from the client's summary `n`, after a turn that
/// runs a new failing command, and `turns` more exchanges of words.
fn window_with_a_new_command(n: usize, turns: usize) -> Vec<Value> {
    window_after(restart(n), turns)
}

/// `opening` (a summary and the user's next message), then a turn that
/// runs a new failing command, and `turns` more exchanges of words.
fn window_after(opening: Vec<Value>, turns: usize) -> Vec<Value> {
    let mut window = opening;
    window.push(json!({"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"command": "npm run lint"}}]}));
    window.push(json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "is_error": true,
         "content": "Exit code 2\nlint: 3 problems"}]}));
    for i in 0..turns {
        window.push(json!({"role": "assistant", "content": format!("Step {i} done.")}));
        window.push(json!({"role": "user", "content": format!("Next, step {}.", i + 1)}));
    }
    window
}

/// The client compacts a second time, its history opening with its first
/// summary (which said nothing of the rule, the file or the command), and
/// its second summary says nothing either: the trail appended after it is
/// the whole trail, the hand-off's before the first summary and the new
/// command after it. The second compaction request itself goes with the
/// first hand-off, as every request since: the model summarizing sees the
/// trail, and the prefix is the one the upstream cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_compaction_keeps_the_trail_of_the_first() {
    let h = Harness::start().await;
    let key = "sk-ant-second-compaction-0001";
    let first = first_restart(&h, key).await;
    let appended = received_messages(&h).pop().unwrap().json()["messages"][0].clone();
    assert_ne!(appended, first[0]);
    // The turns after the first summary: a new failing command, then
    // more than a few requests (sooner, the next is a repeat).
    let few = compactor::engine::FEW_REQUESTS as usize;
    for turns in 0..=few {
        let window = window_with_a_new_command(1, turns);
        assert_eq!(status_of(&h, key, &window).await, 200);
        let sent = received_messages(&h).pop().unwrap().json();
        assert_eq!(sent["messages"][0], appended, "the same bytes");
    }
    let window = window_with_a_new_command(1, few);
    let ask = compaction_request(&window);
    assert_eq!(status_of(&h, key, &ask).await, 200);
    assert_eq!(repeats(&h).await.0, 0, "no repeat");
    let sent = received_messages(&h).pop().unwrap().json();
    assert_eq!(
        sent["messages"][0], appended,
        "the compaction request goes with the hand-off of its prefix"
    );
    assert_eq!(sent["messages"].as_array().unwrap()[1..], ask[1..]);

    // The client goes on from its second summary.
    let block = after_the_second_summary(&h, key).await;
    assert_eq!(
        block.matches("cargo test -p svc").count(),
        1,
        "each command once: {block}"
    );
}

/// The client goes on from its second summary, which says nothing of the
/// trail: the block the upstream gets after that summary, which holds the
/// whole trail, before the first summary and after it.
async fn after_the_second_summary(h: &Harness, key: &str) -> String {
    let next = restart(2);
    assert_eq!(status_of(h, key, &next).await, 200);
    let sent = received_messages(h).pop().unwrap().json();
    assert_eq!(sent["messages"][1], next[1]);
    let first = sent["messages"][0]["content"]
        .as_str()
        .expect("a text message");
    let summary = next[0]["content"].as_str().unwrap();
    let block = first
        .strip_prefix(summary)
        .unwrap_or_else(|| panic!("the summary first: {first}"));
    for fact in [
        "never push to main",
        "svc/port.rs",
        "cargo test -p svc",
        "Exit code 101",
        "npm run lint",
        "Exit code 2",
    ] {
        assert!(block.contains(fact), "{fact} in {block}");
    }
    block.to_string()
}

/// The whole trail the first summary stated, which its window holds only
/// as the client's prose: `restart`'s first messages, that summary's.
fn full_restart() -> Vec<Value> {
    let summary = format!(
        "{HANDOFF} The user said: From now on, never push to main. Wrote svc/port.rs. \
         Ran cargo test -p svc: Exit code 101."
    );
    vec![
        json!({"role": "user", "content": summary}),
        json!({"role": "user", "content": "Go on."}),
    ]
}

/// The client's first summary stated the whole trail, so nothing was
/// appended to it; its second says nothing of it. The trail the first one
/// stated still follows the second: it was kept with the first summary's
/// place, as a hand-off's is, since the history after it holds it only as
/// prose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trail_the_first_summary_stated_whole_follows_the_second() {
    let h = Harness::start().await;
    let key = "sk-ant-stated-whole-0001";
    assert_eq!(status_of(&h, key, &history()).await, 200);
    assert_eq!(
        status_of(&h, key, &compaction_request(&history())).await,
        200
    );
    let few = compactor::engine::FEW_REQUESTS as usize;
    for turns in 0..=few {
        let window = window_after(full_restart(), turns);
        assert_eq!(status_of(&h, key, &window).await, 200);
        let sent = received_messages(&h).pop().unwrap().json();
        assert_eq!(sent["messages"], json!(window), "as it came");
    }
    let ask = compaction_request(&window_after(full_restart(), few));
    assert_eq!(status_of(&h, key, &ask).await, 200);
    assert_eq!(repeats(&h).await.0, 0, "no repeat");

    after_the_second_summary(&h, key).await;
}
