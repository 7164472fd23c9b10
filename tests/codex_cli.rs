//! The real Codex CLI (npm `@openai/codex`, pinned in `scripts/codex.sh`)
//! against the proxy in front of the scripted fake upstream.
//!
//! Codex runs as `codex exec …` then `codex exec resume --last …`, one
//! process per turn, with a temporary `CODEX_HOME` whose `config.toml` names
//! a custom provider (`wire_api = "responses"`) at the proxy, and offline
//! settings (no update check, no analytics, read-only sandbox, approvals
//! never, no client retries).
//!
//! The binary comes from `COMPACTOR_CODEX_BIN` (`.ci/run` exports it); when
//! that is unset the tests run `scripts/codex.sh install` themselves
//! (idempotent: a fraction of a second once installed, ~6 s and ~430 MB the
//! first time) and use the path it prints. They are `#[ignore]`d so a plain
//! `cargo test` stays offline; `scripts/test` runs them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::{next_response_id, FakeUpstream, Received, Reply, AUTO_TEXT};
use serde_json::{json, Value};
use support::real_cli::{self, long_answer, Outcome};
use support::{is_summary_call, Harness};

const MODEL: &str = "tiny-codex";
const KEY: &str = "sk-test";
/// Longest a single `codex exec` turn may take.
const TURN_TIMEOUT: Duration = Duration::from_secs(60);
/// The proxy's window for `tiny*` (trigger at 75%: 18k). Codex's first
/// request (instructions, tool definitions, environment context) is ~40 KB,
/// which the fake reports as ~10k input tokens; each long answer adds ~1.2k,
/// so the session crosses the trigger after a handful of turns.
const WINDOW: u64 = 24_000;
/// The answer's budget the model entry gives.
const MAX_OUTPUT: u64 = 1_000;

/// What Codex prints when the upstream says the prompt does not fit.
const RAN_OUT: &str = "ran out of room in the model's context window";

/// The Codex binary: `COMPACTOR_CODEX_BIN`, else what `scripts/codex.sh
/// install` prints as its last line.
fn codex_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| real_cli::installed("COMPACTOR_CODEX_BIN", "codex"))
}

fn small_window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "tiny*".into(),
        context_window: WINDOW,
        max_output_tokens: Some(MAX_OUTPUT),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// A Codex installation of its own: `CODEX_HOME`, `HOME` and a working
/// directory, all temporary.
struct Codex {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
}

impl Codex {
    /// Codex configured to talk to `base_url` (with `/v1`) over HTTP.
    fn new(base_url: &str) -> Codex {
        Self::with_transport(base_url, false)
    }

    /// Codex configured to talk to `base_url` over a WebSocket, as
    /// `compactor connect codex` writes it.
    fn over_websocket(base_url: &str) -> Codex {
        Self::with_transport(base_url, true)
    }

    fn with_transport(base_url: &str, websocket: bool) -> Codex {
        let home = tempfile::tempdir().expect("tempdir");
        let work = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(home.path().join("codex")).unwrap();
        std::fs::write(work.path().join("README.md"), "# scratch project\n").unwrap();
        let config = format!(
            r#"model = "{MODEL}"
model_provider = "compactor"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
# Codex must not compact by itself: the proxy does.
model_context_window = 1000000
model_auto_compact_token_limit = 1000000

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.compactor]
name = "compactor"
base_url = "{base_url}"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
# No client retries: a proxy failure must show, not be papered over.
request_max_retries = 0
stream_max_retries = 0
supports_websockets = {websocket}
"#
        );
        std::fs::write(home.path().join("codex/config.toml"), config).unwrap();
        Codex { home, work }
    }

    fn codex_home(&self) -> PathBuf {
        self.home.path().join("codex")
    }

    /// `codex exec PROMPT`: a new session.
    async fn exec(&self, prompt: &str) -> Outcome {
        self.run(&["exec", "--strict-config", "--skip-git-repo-check", prompt])
            .await
    }

    /// `codex exec resume --last PROMPT`: the next turn of the latest session.
    async fn resume(&self, prompt: &str) -> Outcome {
        self.run(&[
            "exec",
            "resume",
            "--last",
            "--strict-config",
            "--skip-git-repo-check",
            prompt,
        ])
        .await
    }

    /// Runs codex with a bounded wait, off the runtime's worker threads (the
    /// proxy under test runs on them).
    async fn run(&self, args: &[&str]) -> Outcome {
        let bin = codex_bin().to_path_buf();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let home = self.home.path().to_path_buf();
        let codex_home = self.codex_home();
        let work = self.work.path().to_path_buf();
        let (outcome, finished) = tokio::task::spawn_blocking(move || {
            run_bounded(&bin, &args, &home, &codex_home, &work)
        })
        .await
        .expect("codex runner");
        assert!(
            finished,
            "codex did not finish within {TURN_TIMEOUT:?} (killed)\n{}",
            outcome.describe()
        );
        outcome
    }
}

fn run_bounded(
    bin: &Path,
    args: &[String],
    home: &Path,
    codex_home: &Path,
    work: &Path,
) -> (Outcome, bool) {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .current_dir(work)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("CODEX_HOME", codex_home)
        .env("OPENAI_API_KEY", KEY)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb");
    real_cli::run_bounded(cmd, home, TURN_TIMEOUT)
}

/// A streamed Responses answer with the given output items, as OpenAI sends
/// it: created, in_progress, added/done per item (text deltas for
/// messages), completed with usage.
fn sse_items(items: Vec<Value>, input_tokens: u64) -> Reply {
    let id = next_response_id();
    let mut seq = 0;
    let mut ev = Vec::new();
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        seq += 1;
        ev.push(format!("event: {kind}\ndata: {data}\n\n"));
    };
    let created = json!({"id": id, "object": "response", "status": "in_progress", "model": MODEL, "output": []});
    push("response.created", json!({"response": created}));
    push("response.in_progress", json!({"response": created}));
    for (i, item) in items.iter().enumerate() {
        let mut added = item.clone();
        if added["type"] == "message" {
            added["content"] = json!([]);
            added["status"] = json!("in_progress");
        }
        push(
            "response.output_item.added",
            json!({"output_index": i, "item": added}),
        );
        if item["type"] == "message" {
            push(
                "response.output_text.delta",
                json!({"item_id": item["id"], "output_index": i,
                "content_index": 0, "delta": item["content"][0]["text"]}),
            );
        }
        push(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }
    let output_tokens = 40;
    push(
        "response.completed",
        json!({"response": {"id": id, "object": "response", "status": "completed", "model": MODEL,
            "output": items,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "total_tokens": input_tokens + output_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 8}}}}),
    );
    Reply::sse(ev)
}

fn reasoning(n: u32) -> Value {
    json!({"type": "reasoning", "id": format!("rs_fake{n}"),
           "summary": [{"type": "summary_text", "text": format!("**Thinking** step {n}")}],
           "encrypted_content": format!("gAAAAA-fake-encrypted-{n}-{}", "x".repeat(64))})
}

fn message(n: u32, text: &str) -> Value {
    json!({"type": "message", "id": format!("msg_fake{n}"), "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn function_call(n: u32, cmd: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_fake{n}"), "status": "completed",
           "call_id": format!("call_fake{n}"), "name": "exec_command",
           "arguments": json!({"cmd": cmd}).to_string()})
}

/// The Responses requests the fake received (not the proxy's summary calls).
fn turns(fake: &FakeUpstream) -> Vec<Received> {
    fake.received()
        .into_iter()
        .filter(|r| r.method == http::Method::POST && r.path == "/v1/responses")
        .collect()
}

fn input_items(body: &Value) -> &[Value] {
    body["input"].as_array().map(Vec::as_slice).unwrap_or(&[])
}

fn input_texts(body: &Value) -> Vec<String> {
    input_items(body)
        .iter()
        .map(|i| match &i["content"] {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join(""),
            _ => String::new(),
        })
        .collect()
}

fn has_summary(body: &Value) -> bool {
    input_texts(body)
        .iter()
        .any(|t| t.starts_with("[compactor summary"))
}

fn count(h: &Harness, sql: &str) -> i64 {
    h.db().query_row(sql, [], |r| r.get(0)).unwrap()
}

fn expect_ok(turn: &str, out: &Outcome) {
    eprintln!("{turn}: codex exit {:?} in {:.1?}", out.code, out.elapsed);
    assert!(out.ok(), "{turn}: codex failed\n{}", out.describe());
}

/// One turn whose answer is a reasoning item and a long message; the usage
/// reported is what the request will weigh, as the fake's auto replies count
/// it (bytes / 4): the previous request, the previous answer, the prompt.
async fn long_turn(codex: &Codex, fake: &FakeUpstream, n: u32, first: bool) -> Outcome {
    let prompt = format!("turn {n}: what does the parser do next?");
    let prev = turns(fake).last().map_or(40_000, |r| r.body.len());
    let prev_answer = if first {
        0
    } else {
        long_answer(n - 1).len() + 600
    };
    let input_tokens = ((prev + prev_answer + prompt.len() + 300) / 4) as u64;
    fake.push(sse_items(
        vec![reasoning(n), message(n, &long_answer(n))],
        input_tokens,
    ));
    let out = if first {
        codex.exec(&prompt).await
    } else {
        codex.resume(&prompt).await
    };
    expect_ok(&format!("turn {n}"), &out);
    assert!(
        out.stdout.contains(&format!("Answer {n}: ")),
        "{}",
        out.describe()
    );
    out
}

/// Long turns from turn `n` until one's reported usage crosses the trigger
/// (nothing compacted before); the last turn's number.
async fn long_turns_to_the_trigger(codex: &Codex, h: &Harness, mut n: u32) -> u32 {
    // The trigger is a share of the effective limit: the window less the
    // answer's budget.
    let threshold = ((WINDOW - MAX_OUTPUT) as f64 * 0.75) as i64;
    loop {
        long_turn(codex, &h.fake, n, false).await;
        let used = count(
            h,
            "SELECT input_tokens + output_tokens FROM exchanges ORDER BY id DESC LIMIT 1",
        );
        eprintln!("turn {n}: reported {used} tokens, threshold {threshold}");
        if used >= threshold {
            return n;
        }
        assert_eq!(count(h, "SELECT count(*) FROM compactions"), 0);
        n += 1;
        assert!(n < 12, "the session never crossed the threshold");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_session_crossing_the_threshold_is_compacted_in_one_conversation() {
    let h = Harness::start_with(small_window).await;
    let codex = Codex::new(&h.url());

    // Turn 1: the answer carries a reasoning item (encrypted) and a message.
    long_turn(&codex, &h.fake, 1, true).await;

    // Turn 2: the model calls exec_command; Codex runs it (read-only sandbox)
    // and sends the output back in a second request.
    let t1 = turns(&h.fake)[0].body.len() as u64;
    let usage = (t1 + 7000) / 4;
    h.fake
        .push(sse_items(vec![reasoning(2), function_call(2, "ls")], usage));
    h.fake.push(sse_items(
        vec![message(3, "Listed the files.")],
        usage + 200,
    ));
    let out = codex.resume("turn 2: list the files").await;
    expect_ok("turn 2", &out);
    assert!(
        out.stdout.contains("Listed the files."),
        "{}",
        out.describe()
    );

    let sent = turns(&h.fake);
    assert_eq!(sent.len(), 3, "one request for turn 1, two for turn 2");
    let t2 = sent[1].json();
    let rs = input_items(&t2)
        .iter()
        .find(|i| i["type"] == "reasoning")
        .expect("turn 2 replays turn 1's reasoning");
    assert_eq!(rs["id"], "rs_fake1");
    assert_eq!(rs["encrypted_content"], reasoning(1)["encrypted_content"]);
    let t2b = sent[2].json();
    let items = input_items(&t2b);
    let call = items
        .iter()
        .position(|i| i["type"] == "function_call" && i["call_id"] == "call_fake2")
        .expect("function_call replayed");
    assert_eq!(
        items[call - 1]["id"],
        "rs_fake2",
        "with its reasoning before it"
    );
    assert!(
        items[call + 1..]
            .iter()
            .any(|i| i["type"] == "function_call_output" && i["call_id"] == "call_fake2"),
        "its output follows: {}",
        serde_json::to_string_pretty(&items[call..]).unwrap()
    );

    // Long turns until one's reported usage crosses the trigger; the proxy
    // compacts in the background right after that answer.
    let n = long_turns_to_the_trigger(&codex, &h, 3).await;
    assert!(
        n >= 5,
        "crossed the threshold over several turns, not at once"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while h.state.compactions.is_empty() || count(&h, "SELECT count(*) FROM compactions") == 0 {
        assert!(
            Instant::now() < deadline,
            "the proxy did not compact after turn {n} crossed the threshold (RUST_LOG=info shows why)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (rung, reason): (String, String) = h
        .db()
        .query_row("SELECT rung, reason FROM compactions", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    eprintln!("compaction: {rung}, {reason}");
    assert_eq!(rung, "summary");
    assert!(reason.starts_with("threshold"), "{reason}");

    // The next turn goes upstream rewritten; Codex never notices.
    let before = turns(&h.fake).len();
    let out = codex.resume("turn after compaction: summarize").await;
    expect_ok("turn after compaction", &out);
    assert!(out.stdout.contains(AUTO_TEXT), "{}", out.describe());
    let sent = turns(&h.fake);
    assert!(
        sent[..before].iter().all(|r| !has_summary(&r.json())),
        "nothing rewritten before the compaction"
    );
    let last = sent[before].json();
    assert!(
        has_summary(&last),
        "the turn after the compaction went upstream rewritten: {:?}",
        input_texts(&last)
    );
    let items = input_items(&last);
    assert_eq!(
        items[0]["role"], "developer",
        "the developer prompt stays first"
    );
    assert_eq!(
        input_texts(&last).last().map(String::as_str),
        Some("turn after compaction: summarize")
    );
    // Reasoning of the summarized part is gone; the tail's goes upstream as
    // Codex replays it: our item, plus the `"content": null` Codex adds.
    let kept: Vec<&Value> = items.iter().filter(|i| i["type"] == "reasoning").collect();
    assert!(!kept.is_empty(), "the tail keeps its reasoning");
    assert!(kept.len() < n as usize, "older reasoning was summarized");
    for rs in kept {
        let k: u32 = rs["id"].as_str().unwrap()["rs_fake".len()..]
            .parse()
            .unwrap();
        let ours = reasoning(k);
        let codex_form = json!({"type": "reasoning", "id": ours["id"], "summary": ours["summary"],
                                "content": null, "encrypted_content": ours["encrypted_content"]});
        assert_eq!(
            rs.to_string(),
            codex_form.to_string(),
            "reasoning replayed verbatim"
        );
    }

    // Codex sent its full history every turn (the proxy rewrote only what
    // went upstream): the recorded requests only ever grow.
    let lens: Vec<i64> = h
        .db()
        .prepare("SELECT request_len FROM exchanges ORDER BY id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(lens.windows(2).all(|w| w[0] < w[1]), "{lens:?}");
    assert!(items.len() < *lens.last().unwrap() as usize);

    // One session: one session-id on every request, = prompt_cache_key, and
    // one conversation in the store.
    let ids: std::collections::BTreeSet<String> = sent
        .iter()
        .map(|r| {
            let v = r.headers.get("session-id").expect("session-id header");
            v.to_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let sid = ids.into_iter().next().unwrap();
    for r in &sent {
        assert_eq!(r.json()["prompt_cache_key"], sid.as_str());
    }
    assert_eq!(
        count(&h, "SELECT count(DISTINCT conversation_id) FROM exchanges"),
        1,
        "all turns in one conversation"
    );
    // With a custom provider Codex 0.171 makes no WebSocket attempt (`GET
    // /v1/responses`) and lists no models: every request is a turn's POST or
    // the proxy's summary call.
    for r in h.fake.received() {
        assert!(
            (r.method == http::Method::POST && r.path == "/v1/responses") || is_summary_call(&r),
            "unexpected request {} {}",
            r.method,
            r.path
        );
    }
    assert!(
        h.fake.received().iter().any(is_summary_call),
        "the summary came from the (fake) model"
    );
}

/// Turns 1-4 with long answers, then an upstream that refuses turn 5 once
/// with `context_length_exceeded` (HTTP 400). Returns turn 5's outcome and
/// how many Responses requests the fake had before it.
async fn session_until_overflow(codex: &Codex, fake: &FakeUpstream) -> (Outcome, usize) {
    long_turn(codex, fake, 1, true).await;
    for n in 2..=4 {
        long_turn(codex, fake, n, false).await;
    }
    let before = turns(fake).len();
    fake.push(Reply::context_length_exceeded());
    (codex.resume("turn 5: and now?").await, before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_context_overflow_is_compacted_and_retried_through_the_proxy() {
    let h = Harness::start_with(|c| {
        small_window(c);
        // Compact only because the upstream says so.
        c.compaction.background = false;
    })
    .await;
    let codex = Codex::new(&h.url());
    let (out, before) = session_until_overflow(&codex, &h.fake).await;
    expect_ok("turn 5 (upstream overflowed once)", &out);
    assert!(out.stdout.contains(AUTO_TEXT), "{}", out.describe());
    assert!(!out.stdout.contains(RAN_OUT) && !out.stderr.contains(RAN_OUT));

    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(reason.starts_with("overflow"), "{reason}");
    let sent = turns(&h.fake);
    assert_eq!(sent.len(), before + 2, "the refused request and its retry");
    assert!(!has_summary(&sent[before].json()));
    let retry = sent[before + 1].json();
    assert!(has_summary(&retry), "{:?}", input_texts(&retry));
    assert_eq!(
        input_texts(&retry).last().map(String::as_str),
        Some("turn 5: and now?")
    );
    assert_eq!(
        count(&h, "SELECT count(DISTINCT conversation_id) FROM exchanges"),
        1
    );

    // The session goes on, still compacted upstream.
    expect_ok("turn 6", &codex.resume("turn 6: thanks").await);
    let last = turns(&h.fake).pop().unwrap().json();
    assert!(has_summary(&last), "{:?}", input_texts(&last));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_direct_to_an_overflowing_upstream_runs_out_of_room() {
    let fake = FakeUpstream::start().await.expect("fake upstream");
    let codex = Codex::new(&fake.url());
    let (out, before) = session_until_overflow(&codex, &fake).await;
    assert_eq!(out.code, Some(1), "{}", out.describe());
    let line = out
        .stderr
        .lines()
        .chain(out.stdout.lines())
        .find(|l| l.contains(RAN_OUT))
        .unwrap_or_else(|| panic!("no '{RAN_OUT}' message\n{}", out.describe()));
    eprintln!("direct overflow: {line}");
    assert_eq!(
        turns(&fake).len(),
        before + 1,
        "Codex neither retries nor compacts by itself"
    );
}

/// A turn whose tool output makes up most of the request, refused by the
/// upstream (with `failure`) when Codex sends that output back: everything
/// compactable sits inside the ladder's verbatim tail (the proxy's window
/// for this model is the table's 128k, so its tail holds 16k tokens).
async fn tail_heavy_overflow(failure: Reply) {
    let h = Harness::start_with(|c| c.compaction.background = false).await;
    let codex = Codex::new(&h.url());
    long_turn(&codex, &h.fake, 1, true).await;
    let t1 = turns(&h.fake)[0].body.len() as u64;
    // The model asks for a long listing; Codex runs it and sends it back,
    // and that request is the one refused.
    h.fake.push(sse_items(
        vec![reasoning(2), function_call(2, "seq 1 4000")],
        (t1 + 7000) / 4,
    ));
    h.fake.push(failure);
    let before = turns(&h.fake).len();
    let out = codex.resume("turn 2: count to four thousand").await;
    expect_ok(
        "turn 2 (refused while its tool output filled the tail)",
        &out,
    );
    assert!(out.stdout.contains(AUTO_TEXT), "{}", out.describe());
    assert!(!out.stdout.contains(RAN_OUT) && !out.stderr.contains(RAN_OUT));
    let sent = turns(&h.fake);
    assert_eq!(
        sent.len(),
        before + 3,
        "the call, the refused output, its compacted retry"
    );
    let (refused, retry) = (sent[before + 1].json(), sent[before + 2].json());
    let output_of = |body: &Value| {
        input_items(body)
            .iter()
            .find(|i| i["type"] == "function_call_output" && i["call_id"] == "call_fake2")
            .map(|i| i["output"].to_string().len())
    };
    let (full, cut) = (output_of(&refused), output_of(&retry));
    assert!(
        full.is_some() && cut.is_some() && cut < full,
        "the pending output is still there, shortened: {full:?} -> {cut:?}"
    );
    assert!(retry.to_string().len() < refused.to_string().len() * 9 / 10);
    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(
        reason.starts_with("overflow") && reason.contains("escalated"),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_overflow_with_the_tail_holding_most_of_the_request_is_retried_http_400() {
    tail_heavy_overflow(Reply::context_length_exceeded()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_overflow_with_the_tail_holding_most_of_the_request_is_retried_stream_failed() {
    let failed = |kind: &str, response: Value| {
        format!(
            "event: {kind}\ndata: {}\n\n",
            json!({"type": kind, "response": response})
        )
    };
    tail_heavy_overflow(Reply::sse(vec![
        failed("response.created", json!({"id": "resp_f", "status": "in_progress"})),
        failed("response.failed", json!({"id": "resp_f", "status": "failed",
            "error": {"code": "context_length_exceeded",
                      "message": "Your input exceeds the context window of this model. Please adjust your input and try again."}})),
    ]))
    .await;
}

/// The `x-codex-turn-metadata` `request_kind` of every request Codex sends
/// on the turn after one whose reported tokens, answer included, were
/// `reported`, with `model_context_window = codex_window` (and
/// `model_auto_compact_token_limit` far above it, as before).
async fn kinds_after_a_turn_of(codex_window: u64, reported: u64) -> Vec<String> {
    let fake = support::within(FakeUpstream::start()).await.expect("fake");
    let codex = Codex::new(&fake.url());
    let path = codex.codex_home().join("config.toml");
    let config = std::fs::read_to_string(&path).unwrap().replace(
        "model_context_window = 1000000",
        &format!("model_context_window = {codex_window}"),
    );
    std::fs::write(&path, config).unwrap();
    // `sse_items` reports 40 output tokens besides the input.
    fake.push(sse_items(vec![message(1, "first answer")], reported - 40));
    expect_ok("turn 1", &codex.exec("turn 1: look around").await);
    let before = fake.received().len();
    fake.push(sse_items(vec![message(2, "second answer")], 1_000));
    expect_ok("turn 2", &codex.resume("turn 2: go on").await);
    fake.received()[before..]
        .iter()
        .filter(|r| r.method == http::Method::POST)
        .map(|r| {
            let meta: Value = r
                .headers
                .get("x-codex-turn-metadata")
                .and_then(|v| serde_json::from_slice(v.as_bytes()).ok())
                .unwrap_or(Value::Null);
            meta["request_kind"].as_str().unwrap_or("").to_string()
        })
        .collect()
}

/// Codex compacts by itself at 90% of `model_context_window`, whatever
/// `model_auto_compact_token_limit` says: with the window the proxy uses it
/// did so on a turn that filled the window, and summarized what the proxy
/// had compacted. With the window `connect codex` writes, the fullest turn
/// the upstream can take leaves compaction to the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_leaves_compaction_to_the_proxy_on_the_window_connect_writes() {
    let window = 100_000;
    let kinds = kinds_after_a_turn_of(window, window).await;
    assert_eq!(kinds, ["compaction", "turn"], "Codex's own threshold");
    let written = compactor::cli::connect::codex_context_window(window);
    let kinds = kinds_after_a_turn_of(written, window).await;
    assert_eq!(kinds, ["turn"], "no compaction request of Codex's own");
}

/// `compactor_requests_total` of the WebSocket endpoint for `status`.
async fn websocket_requests(h: &Harness, status: u16) -> u64 {
    let metrics = h.scrape().await;
    let series = format!(
        "compactor_requests_total{{endpoint=\"responses_websocket\",status=\"{status}\"}} "
    );
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_over_the_websocket_runs_a_compacted_session() {
    over_the_websocket(false).await;
}

/// The same, with an upstream that takes the WebSocket too: each turn's
/// requests go over the upstream socket of its client socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Codex CLI: run scripts/test"]
async fn codex_over_the_websocket_to_an_upstream_websocket_runs_a_compacted_session() {
    over_the_websocket(true).await;
}

async fn over_the_websocket(upstream_takes_one: bool) {
    let h = Harness::start_with(small_window).await;
    h.fake.take_websockets(upstream_takes_one);
    let codex = Codex::over_websocket(&h.url());
    long_turn(&codex, &h.fake, 1, true).await;
    let n = long_turns_to_the_trigger(&codex, &h, 2).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while count(&h, "SELECT count(*) FROM compactions") == 0 {
        assert!(Instant::now() < deadline, "no compaction after turn {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = turns(&h.fake).len();
    let out = codex.resume("turn after compaction: summarize").await;
    expect_ok("turn after compaction", &out);
    assert!(out.stdout.contains(AUTO_TEXT), "{}", out.describe());
    let last = turns(&h.fake)[before].json();
    assert!(
        has_summary(&last),
        "the turn after the compaction went upstream rewritten: {:?}",
        input_texts(&last)
    );
    assert_eq!(
        input_texts(&last).last().map(String::as_str),
        Some("turn after compaction: summarize")
    );
    assert_eq!(
        count(&h, "SELECT count(DISTINCT conversation_id) FROM exchanges"),
        1,
        "all turns in one conversation"
    );
    // Every turn came over a WebSocket: one upgrade per `codex` process at
    // least, and each turn's request answered on one.
    let upgrades = websocket_requests(&h, 101).await;
    let answered = websocket_requests(&h, 200).await;
    eprintln!("{upgrades} upgrades, {answered} answers over them");
    assert!(
        upgrades > u64::from(n),
        "{upgrades} upgrades for {} processes",
        n + 1
    );
    assert_eq!(answered, before as u64 + 1, "every turn over the socket");
    let (up_upgrades, refused, up_requests) = h.fake.websockets();
    let all = turns(&h.fake).len();
    if upstream_takes_one {
        assert_eq!(refused, 0);
        assert!(up_upgrades >= 1 && up_upgrades as u64 <= upgrades);
        assert_eq!(up_requests, all, "every turn over the upstream's socket");
    } else {
        assert_eq!((up_upgrades, refused, up_requests), (0, 1, 0));
    }
}
