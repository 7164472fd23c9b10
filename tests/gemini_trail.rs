//! The trail after Gemini CLI's own compression, on real sockets. Gemini
//! CLI names no session: after its compression (a `<state_snapshot>` asked
//! for, then checked) it goes on from a history that opens with its
//! context and the snapshot, and shares nothing else with the one it
//! compressed. The snapshot's text leads that request to the conversation
//! of the compression whose answer it is, so what the snapshot left out of
//! the trail — the user's rule, the file written, the command with its
//! exit status — follows it upstream, appended once, the same bytes on
//! every later request. The same text under another key, or with a
//! conversation named, leads nowhere. A second compression carries that
//! block, and what its snapshot leaves out of the whole trail, the first
//! hand-off's included, follows it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::compaction::summary::HANDOFF_NOTE;
use compactor::fake_upstream::gemini as fake;
use compactor::fake_upstream::Received;
use serde_json::{json, Value};
use support::*;

const KEY: &str = "AIzaSy-gemini-trail-key-0001";
const OTHER_KEY: &str = "AIzaSy-gemini-trail-key-0002";
const MODEL: &str = "tiny-gemini";

fn user(text: &str) -> Value {
    json!({"role": "user", "parts": [{"text": text}]})
}

fn model(text: &str) -> Value {
    json!({"role": "model", "parts": [{"text": text}]})
}

/// Gemini CLI's first content: the session's context.
fn context() -> Value {
    user("This is the Gemini CLI. We are setting up the context for our chat.\nToday's date is Sunday.\nI'm currently working in the directory: /home/u/svc")
}

fn call(name: &str, args: Value) -> Value {
    json!({"role": "model", "parts": [{"functionCall": {"name": name, "args": args}}]})
}

fn response(name: &str, output: &str) -> Value {
    json!({"role": "user", "parts": [{"functionResponse": {"name": name, "response": {"output": output}}}]})
}

/// POSTs `contents` to `generateContent` with `key` (and `headers`); the
/// conversation the proxy named.
async fn send(h: &Harness, key: &str, headers: &[(&str, &str)], contents: &[Value]) -> String {
    let body = json!({"contents": contents,
        "systemInstruction": {"parts": [{"text": "You are a coding agent."}]}});
    let mut req = client()
        .post(format!(
            "http://{}/v1beta/models/{MODEL}:generateContent",
            h.addr
        ))
        .header("content-type", "application/json")
        .header("x-goog-api-key", key)
        .body(serde_json::to_vec(&body).unwrap());
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = within(req.send()).await.expect("request");
    assert_eq!(resp.status(), 200);
    let conversation = resp.headers()["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    within(resp.bytes()).await.expect("body");
    conversation
}

/// Sends `contents` after queueing the fake's `answer` (a model content);
/// the conversation, and `contents` with the answer.
async fn turn(h: &Harness, contents: &[Value], answer: Value) -> (String, Vec<Value>) {
    let prompt = serde_json::to_vec(contents).unwrap().len() as u64 / 4;
    h.fake.push(compactor::fake_upstream::Reply::json(
        200,
        fake::body(answer["parts"].clone(), prompt, 20),
    ));
    let conversation = send(h, KEY, &[], contents).await;
    let mut out = contents.to_vec();
    out.push(answer);
    (conversation, out)
}

/// What the upstream received last.
fn last(h: &Harness) -> Received {
    h.fake.last().expect("a request")
}

/// Gemini CLI's compression of `compressed`: the snapshot asked for
/// (answered `snapshot`, after a thought), then checked (answered
/// `checked`); the conversations of the two requests.
async fn compresses(
    h: &Harness,
    compressed: &[Value],
    snapshot: &str,
    checked: &str,
) -> (String, String) {
    let mut ask = compressed.to_vec();
    ask.push(user("Generate a new <state_snapshot> based on the provided history.\n\nFirst, reason in your scratchpad. Then, generate the updated <state_snapshot>."));
    let answer = json!({"role": "model", "parts": [
        {"text": "Weighing the history.", "thought": true}, {"text": snapshot}]});
    let (asked, _) = turn(h, &ask, answer).await;
    let mut check = compressed.to_vec();
    check.push(model(snapshot));
    check.push(user("Critically evaluate the <state_snapshot> you just generated. Did you omit any specific technical details, file paths, tool results, or user constraints mentioned in the history? If anything is missing or could be more precise, generate a FINAL, improved <state_snapshot>. Otherwise, repeat the exact same <state_snapshot> again."));
    let (checked, _) = turn(h, &check, model(checked)).await;
    (asked, checked)
}

/// The history Gemini CLI goes on from after its compression: its
/// context and `snapshot`, two parts of one content, its thanks, what it
/// `kept`, then the user's `next` message.
fn goes_on(snapshot: &str, kept: &[Value], next: &str) -> Vec<Value> {
    let mut opening = context();
    opening["parts"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "text": snapshot }));
    let mut out = vec![opening, model("Got it. Thanks for the additional context!")];
    out.extend_from_slice(kept);
    out.push(user(next));
    out
}

const SNAPSHOT: &str =
    "<state_snapshot>\n  <overall_goal>Make the svc tests pass.</overall_goal>\n</state_snapshot>";

/// The snapshot the check of it answers, which Gemini CLI goes on from
/// (trimmed): it still says nothing of the rule, the file or the command.
const CHECKED: &str = "<state_snapshot>\n  <overall_goal>Make the svc tests pass.</overall_goal>\n  <key_knowledge>The port lives in the svc crate.</key_knowledge>\n</state_snapshot>";

/// A session with a rule that writes a file and runs a failing command:
/// its conversation and history.
async fn a_session_with_a_trail(h: &Harness) -> (String, Vec<Value>) {
    let opening = vec![
        context(),
        user("Make the svc tests pass. From now on, never push to main."),
    ];
    let write = call(
        "write_file",
        json!({"file_path": "/home/u/svc/src/port.rs", "content": "pub const PORT: u16 = 8123;\n"}),
    );
    let (main, mut history) = turn(h, &opening, write).await;
    history.push(response(
        "write_file",
        "Successfully created and wrote to new file: /home/u/svc/src/port.rs.",
    ));
    let test = call("run_shell_command", json!({"command": "cargo test -p svc"}));
    let (again, h2) = turn(h, &history, test).await;
    assert_eq!(again, main);
    history = h2;
    history.push(response(
        "run_shell_command",
        "Command: cargo test -p svc\nDirectory: (root)\nStdout: error[E0425]: cannot find value `PORT`\nStderr: (empty)\nError: (none)\nExit Code: 101",
    ));
    let (_, h3) = turn(h, &history, model("The port constant is not in scope.")).await;
    (main, h3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trail_gemini_clis_snapshot_left_out_follows_it_in_the_same_conversation() {
    let h = Harness::start().await;
    let (main, mut history) = a_session_with_a_trail(&h).await;
    // What Gemini CLI compresses: the history up to its last user's turn;
    // what it keeps: that turn.
    let compressed = history.clone();
    history.push(user("Go on."));
    let (_, h4) = turn(&h, &history, model("Looking at svc/src/main.rs.")).await;
    history = h4;
    let kept = history[compressed.len()..].to_vec();

    // Its compression: the snapshot asked for, then checked; the check's
    // answer (trimmed) is what it goes on from.
    let (asked, checked) = compresses(&h, &compressed, SNAPSHOT, &format!("\n{CHECKED}\n\n")).await;
    assert_ne!(asked, main, "the compression went on from an older prefix");
    let next = goes_on(CHECKED, &kept, "Now fix it.");

    // The same text under another key is another tenant's: nothing of
    // this one's conversation or trail.
    h.fake.push(fake::text("Which svc?", 100, 5));
    let other = send(&h, OTHER_KEY, &[], &next).await;
    assert!(![main.as_str(), asked.as_str(), checked.as_str()].contains(&other.as_str()));
    assert_eq!(last(&h).json()["contents"], json!(next), "as it came");
    // A request that names its conversation is that conversation's (its
    // last message another, or the request below would be its retry).
    let mut own = next.clone();
    own.pop();
    own.push(user("Now fix it, please."));
    h.fake.push(fake::text("Which svc?", 100, 5));
    let named = send(&h, KEY, &[("x-compactor-conversation", "mine")], &own).await;
    assert_ne!(named, checked);
    assert_eq!(last(&h).json()["contents"], json!(own), "as it came");

    // The request that goes on from the snapshot is the conversation of
    // the compression whose answer the snapshot is; the upstream gets the
    // snapshot with what it left out of the trail.
    let (went_on, mut after) = turn(&h, &next, model("Importing the port.")).await;
    assert_eq!(went_on, checked);
    let sent = last(&h).json();
    let summary = sent["contents"][0]["parts"].as_array().unwrap();
    assert_eq!(summary[..2], next[0]["parts"].as_array().unwrap()[..]);
    let block = summary[2]["text"].as_str().expect("the trail appended");
    assert!(block.starts_with(HANDOFF_NOTE), "{block}");
    for fact in [
        "never push to main",
        "src/port.rs",
        "cargo test -p svc",
        "101",
    ] {
        assert!(block.contains(fact), "{fact} in {block}");
    }
    assert_eq!(
        sent["contents"].as_array().unwrap()[1..],
        next[1..],
        "what followed the snapshot went as it came"
    );

    // The next request goes on in it by its history, with the same bytes;
    // the hand-off was stored once.
    after.push(user("And the tests?"));
    let (later, _) = turn(&h, &after, model("Running them.")).await;
    assert_eq!(later, checked);
    assert_eq!(last(&h).json()["contents"][0], sent["contents"][0]);
    let stored = number(
        &*h.sql(),
        "SELECT count(*) FROM compactions WHERE rung = 'handoff'",
    );
    assert_eq!(stored, 1);
}

/// Gemini CLI's next compression goes on from its last snapshot: its two
/// requests, and the one after, are of the conversation already, the
/// check of the snapshot is no repeat of the compression it checks, and
/// the trail of the history compressed again follows the new snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_compression_goes_on_in_the_conversation_with_its_trail() {
    let h = Harness::start().await;
    let mut history = vec![context(), user("Make the svc tests pass.")];
    let (_, h1) = turn(&h, &history, model("Looking at svc.")).await;
    history = h1;
    let compressed = history.clone();
    history.push(user("Go on."));
    let (_, h2) = turn(&h, &history, model("Reading svc/src/main.rs.")).await;
    let kept = h2[compressed.len()..].to_vec();
    let (_, first) = compresses(&h, &compressed, SNAPSHOT, SNAPSHOT).await;

    // After the first: a rule, a failing command.
    let next = goes_on(
        SNAPSHOT,
        &kept,
        "Run the tests. From now on, never push to main.",
    );
    let test = call("run_shell_command", json!({"command": "cargo test -p svc"}));
    let (went_on, mut history) = turn(&h, &next, test).await;
    assert_eq!(went_on, first);
    history.push(response(
        "run_shell_command",
        "Command: cargo test -p svc\nStdout: (empty)\nStderr: error[E0425]\nError: (none)\nExit Code: 101",
    ));
    let (_, h3) = turn(&h, &history, model("The tests fail.")).await;
    history = h3;
    let compressed = history.clone();
    history.push(user("Fix it."));
    let (_, h4) = turn(&h, &history, model("Fixed.")).await;
    history = h4;
    // More than a few requests after the first compression (sooner, the
    // next is a repeat of it: see `engine::repeats`).
    history.push(user("And the port?"));
    let (_, h5) = turn(&h, &history, model("The port is right.")).await;
    let kept = h5[compressed.len()..].to_vec();

    // The second compression, from a history that opens with the first
    // snapshot.
    let (asked, checked) = compresses(&h, &compressed, CHECKED, CHECKED).await;
    assert_eq!(
        (asked.as_str(), checked.as_str()),
        (first.as_str(), first.as_str())
    );
    assert_eq!(h.state.metrics.storms().client_compaction_repeats(), 0);
    let next = goes_on(CHECKED, &kept, "Go on.");
    let (went_on, _) = turn(&h, &next, model("Done.")).await;
    assert_eq!(went_on, first);
    let sent = last(&h).json();
    let block = sent["contents"][0]["parts"][2]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("the trail appended: {}", sent["contents"][0]));
    for fact in ["never push to main", "cargo test -p svc", "101"] {
        assert!(block.contains(fact), "{fact} in {block}");
    }
}

/// Gemini CLI compresses a second time, its history opening with its first
/// snapshot (which said nothing of the rule, the file or the command), and
/// its second snapshot says nothing of them either: the trail appended
/// after it is the whole trail, the first hand-off's and the new command's.
/// Both requests of the second compression go with the first hand-off, as
/// every request since: the model writing the snapshot sees the trail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_compression_keeps_the_trail_of_the_first() {
    let h = Harness::start().await;
    let (_, compressed) = a_session_with_a_trail(&h).await;
    let (_, first) = compresses(&h, &compressed, SNAPSHOT, CHECKED).await;
    let next = goes_on(CHECKED, &[], "Now run the linter.");
    let lint = call("run_shell_command", json!({"command": "npm run lint"}));
    let (went_on, mut history) = turn(&h, &next, lint).await;
    assert_eq!(went_on, first);
    let appended = last(&h).json()["contents"][0].clone();
    let block = appended["parts"][2]["text"].as_str().unwrap_or_default();
    assert!(block.contains("never push to main"), "{appended}");
    history.push(response(
        "run_shell_command",
        "Command: npm run lint\nStdout: (empty)\nStderr: lint: 3 problems\nError: (none)\nExit Code: 2",
    ));
    let (_, h2) = turn(&h, &history, model("The linter fails.")).await;
    history = h2;
    // More than a few requests (sooner, the next is a repeat).
    for i in 0..=compactor::engine::FEW_REQUESTS {
        history.push(user(&format!("Next, step {i}.")));
        let (_, h3) = turn(&h, &history, model(&format!("Step {i} done."))).await;
        history = h3;
        assert_eq!(last(&h).json()["contents"][0], appended, "the same bytes");
    }

    const AGAIN: &str =
        "<state_snapshot>\n  <overall_goal>Make the svc tests and the linter pass.</overall_goal>\n</state_snapshot>";
    let (asked, checked) = compresses(&h, &history, AGAIN, AGAIN).await;
    assert_eq!(
        (asked.as_str(), checked.as_str()),
        (first.as_str(), first.as_str())
    );
    assert_eq!(h.state.metrics.storms().client_compaction_repeats(), 0);
    let got = h.fake.received();
    for r in &got[got.len() - 2..] {
        let contents = r.json()["contents"].clone();
        assert_eq!(
            contents[0], appended,
            "the compression goes with the hand-off"
        );
        assert_eq!(contents.as_array().unwrap()[1..history.len()], history[1..]);
    }

    let next = goes_on(AGAIN, &[], "Go on.");
    let (went_on, _) = turn(&h, &next, model("Done.")).await;
    assert_eq!(went_on, first);
    let sent = last(&h).json();
    let summary = sent["contents"][0]["parts"].as_array().unwrap();
    assert_eq!(summary[..2], next[0]["parts"].as_array().unwrap()[..]);
    let block = summary
        .get(2)
        .and_then(|p| p["text"].as_str())
        .unwrap_or_else(|| panic!("the trail appended: {}", sent["contents"][0]));
    for fact in [
        "never push to main",
        "src/port.rs",
        "cargo test -p svc",
        "101",
        "npm run lint",
        "Exit Code: 2",
    ] {
        assert!(block.contains(fact), "{fact} in {block}");
    }
    assert_eq!(block.matches("cargo test -p svc").count(), 1, "{block}");
}
