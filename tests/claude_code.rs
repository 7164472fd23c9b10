//! The real Claude Code CLI (npm `@anthropic-ai/claude-code`, pinned in
//! `scripts/claude.sh`) against the proxy in front of the scripted fake
//! upstream's Messages endpoint, which refuses what the API documents it
//! refuses (`compactor::fake_upstream::anthropic`).
//!
//! Claude Code runs as `claude -p PROMPT` (print mode: one agent loop, the
//! final answer on stdout) with `ANTHROPIC_BASE_URL` at the proxy, a
//! placeholder `ANTHROPIC_API_KEY`, a temporary `HOME` and config dir, only
//! its `Bash` tool (allowed without asking), and every kind of background
//! traffic off (telemetry, error reports, the auto-updater, non-essential
//! requests). The fake answers with thinking and `Bash` calls of harmless
//! commands (`cat` of files in a temporary working directory), so the
//! results Claude Code sends back are what it really ran.
//!
//! The binary comes from `COMPACTOR_CLAUDE_BIN`, else `scripts/claude.sh
//! install` (see `tests/claude/mod.rs`). The tests are `#[ignore]`d so a
//! plain `cargo test` stays offline; `scripts/test` runs them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod claude;
mod support;

use compactor::config::{Config, ModelConfig};
// One name for the fake's Messages rules, so a move of the module is one line.
use claude::{Claude, KEY, MAX_OUTPUT, MODEL};
use compactor::fake_upstream::anthropic::{self, Answer};
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};
use support::{compactions, Harness};

/// The window the proxy is configured with for `claude-tiny*`: larger than
/// the upstream's, so the first overflow comes from the upstream and the
/// proxy learns the real one from its answer.
const CONFIGURED_WINDOW: u64 = 16_000;
/// The window the fake upstream enforces (tokens as it counts them: bytes
/// of the body / 4). Claude Code's first request with only `Bash` is about
/// 9.5 KB (~2.4k tokens); every step adds a ~3 KB tool result.
const UPSTREAM_WINDOW: u64 = 8_000;
/// The base URL Claude Code is given: the proxy's origin (it appends
/// `/v1/messages` itself).
pub fn base_url(h: &Harness) -> String {
    format!("http://{}", h.addr)
}

fn tiny_claude(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "claude-tiny*".into(),
        context_window: CONFIGURED_WINDOW,
        max_output_tokens: Some(MAX_OUTPUT),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// The Messages requests Claude Code made through the proxy (the proxy's
/// own summary calls left out), oldest first.
fn client_requests(h: &Harness) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages" && !anthropic::is_summarizer_request(&r.json()))
        .collect()
}

/// A ~3 KB log file, different for every step, with a line only it has.
fn log_file(step: usize) -> String {
    let mut out = format!("ledger-entry-{step:02}: balance checked\n");
    for i in 0..70 {
        out.push_str(&format!(
            "step {step:02} record {i:02}: account {i:03} reconciled without a difference\n"
        ));
    }
    out.truncate(3000);
    out
}

/// Every text a request holds in its `tool_result` blocks.
fn tool_results(body: &Value) -> String {
    let mut out = String::new();
    for m in body["messages"].as_array().into_iter().flatten() {
        for b in m["content"].as_array().into_iter().flatten() {
            if b["type"] == "tool_result" {
                out.push_str(&b["content"].to_string());
            }
        }
    }
    out
}

const TASK: &str = "Task: reconcile the ledger in logs/; the auditor's codeword is MAGPIE-7; \
                    report the last balance.";
const FINAL: &str = "All sixty ledgers reconciled; the last balance is 42.";
const STEPS: usize = 60;

/// A Claude Code session with thinking on and sixty `Bash` calls, each
/// result ~3 KB, against an upstream whose window it exceeds several times
/// over, and which the proxy is told is twice as large as it is: the first
/// overflow is the upstream's, answered "prompt is too long", which the
/// proxy compacts and retries (learning the window), and Claude Code never
/// sees. It exits 0 with the final answer; every request the upstream got
/// keeps the API's rules; the task is in the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code CLI: run scripts/test"]
async fn claude_code_session_past_a_small_window_is_compacted_and_its_overflow_retried() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(UPSTREAM_WINDOW));
    let claude = Claude::new();
    let logs = claude.work.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    for step in 0..STEPS {
        std::fs::write(logs.join(format!("{step:02}.txt")), log_file(step)).unwrap();
        h.fake.push(Reply::Messages(
            Answer::tool_use(
                &format!("toolu_{step:02}"),
                "Bash",
                json!({"command": format!("cat logs/{step:02}.txt"),
                       "description": format!("Read ledger {step:02}")}),
            )
            .thinking(&format!("Ledger {step:02} next.")),
        ));
    }
    h.fake
        .push(Reply::Messages(Answer::text(FINAL).thinking("Done.")));

    let out = claude
        .print(TASK, &[("ANTHROPIC_BASE_URL", &base_url(&h))])
        .await;
    let requests = finished_cleanly(&h, &out, &["prompt is too long", "exceed context limit"]);
    assert_eq!(
        requests.len(),
        STEPS + 1 + overflowed(&requests),
        "one request per step, the final one, and each refused one sent again"
    );

    // Every request the upstream got keeps every rule but the window (an
    // overflow is answered, then retried).
    for r in &requests {
        let v = r.json();
        assert!(
            anthropic::check(&v, &r.headers, None).is_none(),
            "a request the API would refuse went upstream: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(
            r.query.as_deref(),
            Some("beta=true"),
            "the query went as sent"
        );
        assert_eq!(r.headers["x-api-key"], KEY);
        assert_eq!(v["model"], MODEL);
    }
    assert_eq!(
        overflowed(&requests),
        1,
        "the upstream refused exactly once, then the proxy knew its window"
    );
    assert!(compactions(&h) >= 1, "the conversation was compacted");
    // Bash really ran in the working directory: every step's file is in
    // some request's tool results.
    let all_results: String = requests.iter().map(|r| tool_results(&r.json())).collect();
    for step in 0..STEPS {
        assert!(
            all_results.contains(&format!("ledger-entry-{step:02}")),
            "the result of step {step} went upstream"
        );
    }
    let sent: usize = requests.iter().map(|r| r.body.len()).sum();
    assert!(
        sent as u64 / 4 > 3 * UPSTREAM_WINDOW,
        "the session is several windows long: {} tokens",
        sent / 4
    );
    let last = requests.last().unwrap();
    assert!(
        anthropic::check(&last.json(), &last.headers, Some(UPSTREAM_WINDOW)).is_none(),
        "the last request fits"
    );
    let last = last.json();
    // The task survives: in the first message as Claude Code sent it while
    // pruning outputs is enough, in the summary once it is not.
    let first = &last["messages"][0];
    let text = compactor::compaction::items::text_of(first);
    assert!(
        text.contains("MAGPIE-7") && text.contains("reconcile the ledger"),
        "the task survives: {text}"
    );
    let summarized = compactor::compaction::items::is_summary(first);
    eprintln!(
        "{} requests, {} compactions, the last one {}",
        requests.len(),
        compactions(&h),
        if summarized { "summarized" } else { "pruned" }
    );
    // Claude Code's own parameters went as it sent them.
    assert_eq!(last["thinking"]["type"], "adaptive", "{}", last["thinking"]);
    assert_eq!(
        last["context_management"]["edits"][0]["type"],
        "clear_thinking_20251015"
    );
    // All of it is one conversation, under Claude Code's session id.
    h.wait_exchanges(requests.len() as i64 - overflowed(&requests) as i64)
        .await;
    let conversations = support::number(
        &*h.sql(),
        "SELECT count(DISTINCT conversation_id) FROM exchanges WHERE endpoint = '/messages'",
    );
    assert_eq!(conversations, 1);
}

/// The Messages requests of a Claude Code run (described on stderr for
/// the test's log), once it exited 0 with [`FINAL`] and said none of
/// `refusals` (what an error reaching it would show).
fn finished_cleanly(h: &Harness, out: &claude::Outcome, refusals: &[&str]) -> Vec<Received> {
    let requests = client_requests(h);
    describe_requests(&h.fake.received());
    assert_eq!(out.code, Some(0), "{}", out.describe());
    assert!(out.stdout.contains(FINAL), "{}", out.describe());
    for said in [&out.stdout, &out.stderr] {
        if let Some(r) = refusals.iter().find(|r| said.contains(**r)) {
            panic!("Claude Code was told {r:?}: {}", out.describe());
        }
    }
    requests
}

/// How many of these requests the fake refused for its window ("prompt is
/// too long", or the prompt and `max_tokens` over the window).
fn overflowed(requests: &[Received]) -> usize {
    requests
        .iter()
        .filter(|r| anthropic::check(&r.json(), &r.headers, Some(UPSTREAM_WINDOW)).is_some())
        .count()
}

/// What Claude Code sent, on stderr for the test's log: paths and queries,
/// the headers' names, the body's keys and sizes.
fn describe_requests(received: &[Received]) {
    for r in received {
        let v = r.json();
        let mut names: Vec<&str> = r.headers.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        let kind = if anthropic::is_summarizer_request(&v) {
            "proxy summary"
        } else {
            "client"
        };
        eprintln!(
            "{} {}{} [{kind}] {} bytes, {} messages, keys {:?}, anthropic-beta {:?}, headers {:?}",
            r.method,
            r.path,
            r.query
                .as_deref()
                .map(|q| format!("?{q}"))
                .unwrap_or_default(),
            r.body.len(),
            v["messages"].as_array().map_or(0, Vec::len),
            support::keys(&v),
            r.headers
                .get("anthropic-beta")
                .and_then(|b| b.to_str().ok())
                .unwrap_or(""),
            names,
        );
    }
}

/// The upstream's window for the session that reads a large file: less
/// than the file alone.
const SMALL_WINDOW: u64 = 6_000;

/// A file of ~29 KB (~7.2k tokens as the fake counts): alone over
/// [`SMALL_WINDOW`], and under the 30,000 characters past which Claude
/// Code keeps a `Bash` result in a file and sends a preview instead.
fn big_file() -> String {
    let mut out = String::from("BIG-FILE-HEAD: generated ledger dump\n");
    let mut i = 0;
    while out.len() < 29_000 {
        out.push_str(&format!(
            "dump row {i:05}: account {:03} moved {i} units between ledgers\n",
            i % 997
        ));
        i += 1;
    }
    out.push_str("BIG-FILE-TAIL: end of dump\n");
    out
}

/// A Claude Code session with thinking on whose second `Bash` call reads a
/// file larger than the upstream's window (which the proxy is told is
/// larger than it is), inside the open tool loop: the
/// upstream's "prompt is too long" is compacted at once, escalating to
/// truncating the current result into the compacted prefix with its call,
/// whose thinking block stays (the API requires it there) and may be
/// dropped. No 400 reaches Claude Code: it exits 0 with the final answer,
/// and every request the upstream got keeps the API's rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code CLI: run scripts/test"]
async fn claude_code_reading_a_file_larger_than_the_window_with_thinking_on_gets_no_400() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(SMALL_WINDOW));
    let claude = Claude::new();
    let logs = claude.work.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    std::fs::write(logs.join("00.txt"), log_file(0)).unwrap();
    std::fs::write(logs.join("dump.txt"), big_file()).unwrap();
    let read = |id: &str, path: &str, thought: &str| {
        Reply::Messages(
            Answer::tool_use(
                id,
                "Bash",
                json!({"command": format!("cat {path}"), "description": format!("Read {path}")}),
            )
            .thinking(thought),
        )
    };
    h.fake
        .push(read("toolu_00", "logs/00.txt", "The first ledger."));
    h.fake
        .push(read("toolu_01", "logs/dump.txt", "Now the whole dump."));
    h.fake
        .push(read("toolu_02", "logs/00.txt", "Once more, to compare."));
    h.fake
        .push(Reply::Messages(Answer::text(FINAL).thinking("Done.")));
    let out = claude
        .print(TASK, &[("ANTHROPIC_BASE_URL", &base_url(&h))])
        .await;
    let requests = finished_cleanly(&h, &out, &["400", "thinking block", "too long"]);
    for r in &requests {
        assert!(
            anthropic::check(&r.json(), &r.headers, None).is_none(),
            "a request the API would refuse went upstream: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    // The file really went: its head in the results the upstream got, the
    // part the window has no room for elided, with a marker saying so.
    assert!(big_file().len() as u64 / 4 > SMALL_WINDOW);
    let results: Vec<String> = requests.iter().map(|r| tool_results(&r.json())).collect();
    assert!(
        results
            .iter()
            .any(|t| t.contains("BIG-FILE-HEAD") && t.contains("bytes of tool output elided")),
        "the file's read went upstream, truncated"
    );
    assert!(compactions(&h) >= 1, "the conversation was compacted");
    // Four steps, each refused one sent again: bounded.
    let refused = requests
        .iter()
        .filter(|r| anthropic::check(&r.json(), &r.headers, Some(SMALL_WINDOW)).is_some())
        .count();
    eprintln!("{} requests, {refused} refused as too long", requests.len());
    assert_eq!(
        requests.len(),
        4 + refused,
        "one request per step and each refused one sent again"
    );
    assert!(refused <= 2, "{refused}");
    let last = requests.last().unwrap();
    assert!(
        anthropic::check(&last.json(), &last.headers, Some(SMALL_WINDOW)).is_none(),
        "the last request fits"
    );
}
