//! The real Gemini CLI (npm `@google/gemini-cli`, pinned in
//! `scripts/gemini.sh`) through `compactor connect gemini-cli` and
//! `compactor run`, against the proxy in front of the scripted fake
//! upstream.
//!
//! Gemini CLI runs as `gemini -p …` then `gemini --resume latest -p …`, one
//! process per turn, with a temporary home whose `settings.json` is the
//! user's (no usage statistics, telemetry or update checks) with what
//! `connect gemini-cli` adds (API-key auth, the model, the compression
//! threshold), and `compactor run` setting `GOOGLE_GEMINI_BASE_URL`.
//!
//! The binary comes from `COMPACTOR_GEMINI_BIN` (`scripts/test` exports
//! it); when that is unset the tests run `scripts/gemini.sh install`
//! themselves (idempotent: a fraction of a second once installed, a few
//! seconds the first time) and use the path it prints. They are
//! `#[ignore]`d so a plain `cargo test` stays offline; `scripts/test` runs
//! them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use compactor::compaction::summary::{HANDOFF_NOTE, SUMMARIZER_MARKER};
use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::{gemini, FakeUpstream, Received, Reply};
use serde_json::{json, Value};
use support::real_cli::{self, long_answer, Outcome};
use support::{number, Harness};

const MODEL: &str = "tiny-gemini";
const KEY: &str = "AIza-test-gemini-cli-key";
/// Longest a single `gemini` turn may take.
const TURN_TIMEOUT: Duration = Duration::from_secs(90);
/// The proxy's window for `tiny-gemini*` (trigger at 75% of the window
/// less the answer's budget: 11,250). Gemini CLI's first request (system
/// prompt, tool declarations, session context) is ~31 KB, which the fake
/// counts as ~7.8k tokens; each long answer adds ~1.3k, so the session
/// crosses the trigger after a few turns.
const WINDOW: u64 = 16_000;
/// The answer's budget the model entry gives.
const MAX_OUTPUT: u64 = 1_000;
/// The window Gemini CLI assumes for every model but Gemma 4.
const ASSUMED: f64 = 1_048_576.0;

/// The Gemini CLI binary: `COMPACTOR_GEMINI_BIN`, else what
/// `scripts/gemini.sh install` prints as its last line.
fn gemini_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| real_cli::installed("COMPACTOR_GEMINI_BIN", "gemini"))
}

fn small_window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "tiny-gemini*".into(),
        context_window: WINDOW,
        max_output_tokens: Some(MAX_OUTPUT),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// The same entry as a proxy.toml, for the `compactor` commands the tests
/// run (`connect` reads the window from it).
fn small_window_toml() -> String {
    format!(
        "[[models]]\nmatch = \"tiny-gemini*\"\ncontext_window = {WINDOW}\nmax_output_tokens = {MAX_OUTPUT}\n"
    )
}

/// A Gemini CLI installation of its own: a temporary home (its
/// `.gemini/settings.json`) and working directory, and the proxy it is
/// connected to.
struct Gemini {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    /// The proxy's address, `host:port`.
    listen: String,
}

impl Gemini {
    /// The user's settings (nothing phones home), then `compactor connect
    /// gemini-cli --write --yes` for [`MODEL`] at the harness's proxy.
    async fn connect(h: &Harness) -> Gemini {
        Self::connect_with(h, "").await
    }

    /// [`Gemini::connect`] with `toml` added to the proxy.toml `connect`
    /// reads (the harness's own settings are its config's).
    async fn connect_with(h: &Harness, toml: &str) -> Gemini {
        let home = tempfile::tempdir().expect("tempdir");
        let work = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            work.path().join("notes.txt"),
            "The parser is in src/parse.rs.\n",
        )
        .unwrap();
        let dir = home.path().join(".gemini");
        std::fs::create_dir_all(&dir).unwrap();
        let mine = json!({
            "general": {"enableAutoUpdate": false, "enableAutoUpdateNotification": false},
            "privacy": {"usageStatisticsEnabled": false},
            "telemetry": {"enabled": false},
        });
        std::fs::write(dir.join("settings.json"), mine.to_string()).unwrap();
        let config = home.path().join("proxy.toml");
        std::fs::write(&config, format!("{}{toml}", small_window_toml())).unwrap();
        let listen = h.addr.to_string();
        let gemini = Gemini { home, work, listen };
        let args = [
            "connect",
            "gemini-cli",
            "--write",
            "--yes",
            "--offline",
            "--model",
            MODEL,
            "--listen",
            &gemini.listen,
            "--config",
            config.to_str().unwrap(),
        ];
        let out = gemini.run_compactor(&args).await;
        assert_eq!(out.code, Some(0), "connect: {}", out.describe());
        gemini
    }

    fn settings(&self) -> Value {
        let path = self.home.path().join(".gemini/settings.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).expect("settings JSON")
    }

    /// `gemini -p PROMPT` through `compactor run`: a new session.
    async fn first(&self, prompt: &str) -> Outcome {
        let bin = gemini_bin().to_str().unwrap().to_string();
        self.turn(&[&bin, "-p", prompt]).await
    }

    /// `gemini --resume latest -p PROMPT`: the next turn of the session.
    async fn next(&self, prompt: &str) -> Outcome {
        let bin = gemini_bin().to_str().unwrap().to_string();
        self.turn(&[&bin, "--resume", "latest", "-p", prompt]).await
    }

    async fn turn(&self, gemini: &[&str]) -> Outcome {
        let mut args = vec!["run", "--listen", &self.listen, "--"];
        args.extend_from_slice(gemini);
        let out = self.run_compactor(&args).await;
        eprintln!("gemini: exit {:?} in {:.1?}", out.code, out.elapsed);
        out
    }

    /// Runs the `compactor` binary with a bounded wait, off the runtime's
    /// worker threads (the proxy under test runs on them).
    async fn run_compactor(&self, args: &[&str]) -> Outcome {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let home = self.home.path().to_path_buf();
        let work = self.work.path().to_path_buf();
        let (outcome, finished) =
            tokio::task::spawn_blocking(move || run_bounded(&args, &home, &work))
                .await
                .expect("runner");
        assert!(
            finished,
            "not finished within {TURN_TIMEOUT:?} (killed)\n{}",
            outcome.describe()
        );
        outcome
    }
}

fn run_bounded(args: &[String], home: &Path, work: &Path) -> (Outcome, bool) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_compactor"));
    cmd.args(args)
        .current_dir(work)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("GEMINI_API_KEY", KEY)
        // Headless runs need the folder trusted (or --skip-trust).
        .env("GEMINI_CLI_TRUST_WORKSPACE", "true")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("NO_COLOR", "1")
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb");
    real_cli::run_bounded(cmd, home, TURN_TIMEOUT)
}

/// A streamed answer as the API sends it with `alt=sse`: each event a
/// whole `GenerateContentResponse`, `parts` split over two events, the
/// last with the finish reason and the usage.
fn sse(parts: Vec<Value>, prompt: u64) -> Reply {
    let output = 40;
    let event = |parts: &[Value], last: bool| {
        let mut chunk = json!({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
                               "usageMetadata": {"promptTokenCount": prompt, "totalTokenCount": prompt},
                               "modelVersion": MODEL, "responseId": "fake-gemini-cli"});
        if last {
            chunk["candidates"][0]["finishReason"] = json!("STOP");
            chunk["usageMetadata"] = json!({"promptTokenCount": prompt, "candidatesTokenCount": output,
                                            "totalTokenCount": prompt + output});
        }
        format!("data: {chunk}\r\n\r\n")
    };
    match parts.len() {
        0 | 1 => Reply::sse(vec![event(&parts, true)]),
        n => Reply::sse(vec![
            event(&parts[..n / 2], false),
            event(&parts[n / 2..], true),
        ]),
    }
}

/// A thought and a long text, as Gemini 2.5 answers with thinking on.
fn long_parts(n: u32) -> Vec<Value> {
    vec![
        json!({"text": format!("Thinking about turn {n}."), "thought": true}),
        json!({"text": long_answer(n)}),
    ]
}

/// The body's `systemInstruction` text.
fn system_text(body: &Value) -> String {
    body.pointer("/systemInstruction/parts")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// Whether the request is the proxy's own summary call.
fn is_summary_call(r: &Received) -> bool {
    system_text(&r.json()).contains(SUMMARIZER_MARKER) || support::is_summary_call(r)
}

/// The client's turns the fake received (not the proxy's summary calls).
fn turns(fake: &FakeUpstream) -> Vec<Received> {
    fake.received()
        .into_iter()
        .filter(|r| r.path.ends_with(":streamGenerateContent") && !is_summary_call(r))
        .collect()
}

fn contents(body: &Value) -> &[Value] {
    body["contents"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// Every text part of the contents.
fn texts(body: &Value) -> Vec<String> {
    contents(body)
        .iter()
        .flat_map(|c| c["parts"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["text"].as_str().map(str::to_string))
        .collect()
}

fn has_summary(body: &Value) -> bool {
    texts(body).iter().any(|t| t.contains("[compactor summary"))
}

fn expect_ok(turn: &str, out: &Outcome) {
    assert_eq!(
        out.code,
        Some(0),
        "{turn}: gemini failed\n{}",
        out.describe()
    );
}

/// The snapshot the fake answers Gemini CLI's compression with.
const SNAPSHOT: &str = "<state_snapshot>the parser, turn 1</state_snapshot>";

/// A turn that reads the notes twice, its first call reported under
/// `point` and its second past it, then Gemini CLI's compression (its
/// snapshot, the same again on its check: it says nothing of the trail),
/// then the turn's end, `answer`.
fn push_compressing_turn(fake: &FakeUpstream, point: u64, answer: &str) {
    let read = |reported| {
        sse(
            vec![
                json!({"functionCall": {"name": "read_file", "args": {"file_path": "notes.txt"}}}),
            ],
            reported,
        )
    };
    fake.push(read(point - 100));
    fake.push(read(point + 100));
    fake.push(gemini::text(SNAPSHOT, 4_000, 50));
    fake.push(gemini::text(SNAPSHOT, 4_100, 50));
    fake.push(sse(vec![json!({"text": answer})], 3_000));
}

/// One turn whose answer is a thought and a long text; the usage reported
/// is what the request will weigh, as the fake counts it (bytes / 4): the
/// previous request, the previous answer, the prompt.
async fn long_turn(gemini: &Gemini, fake: &FakeUpstream, n: u32) -> Outcome {
    let prompt = format!("turn {n}: what does the parser do next?");
    let prev = turns(fake).last().map_or(31_000, |r| r.body.len());
    let prev_answer = if n == 1 {
        0
    } else {
        long_answer(n - 1).len() + 200
    };
    let prompt_tokens = ((prev + prev_answer + prompt.len() + 100) / 4) as u64;
    fake.push(sse(long_parts(n), prompt_tokens));
    let out = if n == 1 {
        gemini.first(&prompt).await
    } else {
        gemini.next(&prompt).await
    };
    expect_ok(&format!("turn {n}"), &out);
    assert!(
        out.stdout.contains(&format!("Answer {n}: ")),
        "{}",
        out.describe()
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Gemini CLI: run scripts/test"]
async fn gemini_cli_session_through_connect_is_compacted_by_the_proxy() {
    let h = Harness::start_with(small_window).await;
    let gemini = Gemini::connect(&h).await;

    // What connect wrote: Gemini CLI's own compression a quarter past the
    // proxy's window, which no prompt through the proxy reaches.
    let settings = gemini.settings();
    assert_eq!(
        settings["security"]["auth"]["selectedType"],
        "gemini-api-key"
    );
    assert_eq!(settings["model"]["name"], MODEL);
    assert_eq!(
        settings["privacy"]["usageStatisticsEnabled"], false,
        "the user's keys stay"
    );
    let share = settings["model"]["compressionThreshold"].as_f64().unwrap();
    assert_eq!(
        (share * ASSUMED).round() as u64,
        WINDOW * 5 / 4,
        "{settings}"
    );

    // Long turns until one's reported usage crosses the trigger; the proxy
    // compacts in the background right after that answer.
    let threshold = ((WINDOW - MAX_OUTPUT) as f64 * 0.75) as i64;
    let mut n = 1;
    loop {
        long_turn(&gemini, &h.fake, n).await;
        let used = number(
            &*h.sql(),
            "SELECT input_tokens + output_tokens FROM exchanges ORDER BY id DESC LIMIT 1",
        );
        eprintln!("turn {n}: reported {used} tokens, threshold {threshold}");
        if used >= threshold {
            break;
        }
        assert_eq!(number(&*h.sql(), "SELECT count(*) FROM compactions"), 0);
        n += 1;
        assert!(n < 10, "the session never crossed the threshold");
    }
    assert!(
        n >= 3,
        "crossed the threshold over several turns, not at once"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while number(&*h.sql(), "SELECT count(*) FROM compactions") == 0 {
        assert!(
            Instant::now() < deadline,
            "the proxy did not compact after turn {n} crossed the threshold"
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
    assert!(reason.starts_with("threshold"), "{reason}");

    // The next turn: the model calls read_file, Gemini CLI runs it and
    // sends the result; both requests go upstream rewritten, the call and
    // its response paired, the thought signature kept.
    let before = turns(&h.fake).len();
    let prompt_tokens = (turns(&h.fake)[before - 1].body.len() / 4) as u64;
    h.fake.push(sse(
        vec![
            json!({"text": "Reading the notes.", "thought": true}),
            json!({"functionCall": {"name": "read_file", "args": {"file_path": "notes.txt"}},
                   "thoughtSignature": "c2lnbmVkLWJ5LXRoZS1mYWtl"}),
        ],
        prompt_tokens,
    ));
    h.fake.push(sse(
        vec![json!({"text": "The notes name src/parse.rs."})],
        prompt_tokens,
    ));
    let out = gemini
        .next("turn after compaction: what do the notes say?")
        .await;
    expect_ok("turn after compaction", &out);
    assert!(
        out.stdout.contains("The notes name src/parse.rs."),
        "{}",
        out.describe()
    );

    let sent = turns(&h.fake);
    assert_eq!(sent.len(), before + 2, "the call, then its result");
    assert!(
        sent[..before].iter().all(|r| !has_summary(&r.json())),
        "nothing rewritten before the compaction"
    );
    let call_turn = sent[before].json();
    assert!(
        has_summary(&call_turn),
        "rewritten: {:?}",
        texts(&call_turn)
    );
    assert_eq!(
        texts(&call_turn).last().map(String::as_str),
        Some("turn after compaction: what do the notes say?")
    );
    let result_turn = sent[before + 1].json();
    assert!(
        has_summary(&result_turn),
        "rewritten: {:?}",
        texts(&result_turn)
    );
    let items = contents(&result_turn);
    let call = items
        .iter()
        .position(|c| c["parts"][0]["functionCall"]["name"] == "read_file")
        .expect("the call replayed");
    assert_eq!(
        items[call]["parts"][0]["thoughtSignature"], "c2lnbmVkLWJ5LXRoZS1mYWtl",
        "the signature kept"
    );
    let response = &items[call + 1]["parts"][0]["functionResponse"];
    assert_eq!(response["name"], "read_file", "{}", items[call + 1]);
    assert!(
        response.to_string().contains("src/parse.rs"),
        "the file's content: {response}"
    );
    assert!(
        result_turn.to_string().len() < sent[before - 1].body.len(),
        "smaller upstream than the last uncompacted turn"
    );

    // Every request reached the fake at Gemini's path, with the key in its
    // header and no key in any query; one conversation in the store; the
    // summary came from the (fake) model; Gemini CLI never compressed by
    // itself (its compression is a generateContent call of its own).
    for r in h.fake.received() {
        assert!(
            r.path == format!("/v1/models/{MODEL}:streamGenerateContent") || is_summary_call(&r),
            "unexpected request {} {}?{:?}",
            r.method,
            r.path,
            r.query
        );
        assert!(
            !r.query.as_deref().unwrap_or("").contains("key="),
            "{:?}",
            r.query
        );
    }
    for r in turns(&h.fake) {
        assert_eq!(r.headers.get("x-goog-api-key").unwrap(), KEY);
        assert_eq!(r.query.as_deref(), Some("alt=sse"));
    }
    assert!(h.fake.received().iter().any(is_summary_call));
    assert_eq!(
        number(
            &*h.sql(),
            "SELECT count(DISTINCT conversation_id) FROM exchanges"
        ),
        1,
        "all turns in one conversation"
    );
    let recorded: i64 = number(&*h.sql(), "SELECT count(*) FROM exchanges");
    assert_eq!(
        recorded,
        turns(&h.fake).len() as i64,
        "every turn recorded once"
    );
}

/// What Gemini CLI 0.61 sent for one turn with a tool call
/// (`tests/fixtures/gemini-cli-request.json`), replayed through the proxy:
/// each request reaches the upstream at its path below the base, `alt=sse`
/// kept, the key in `x-goog-api-key`, its contents as the CLI sent them,
/// and both are recorded in one conversation. Needs no CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorded_gemini_cli_turn_goes_through_as_sent() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gemini-cli-request.json"
    );
    let recorded: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let requests = recorded["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 2);
    let h = Harness::start().await;
    let origin = h.url().strip_suffix("/v1").unwrap().to_string();
    h.fake.push(sse(
        vec![
            json!({"text": "Let me read it.", "thought": true}),
            json!({"functionCall": {"name": "read_file", "args": {"file_path": "notes.txt"}},
                   "thoughtSignature": "c2lnbmF0dXJl"}),
        ],
        7_800,
    ));
    h.fake
        .push(sse(vec![json!({"text": "It says hello world."})], 7_900));
    for (i, r) in requests.iter().enumerate() {
        let mut req = support::client().post(format!(
            "{origin}{}?{}",
            r["path"].as_str().unwrap(),
            r["query"].as_str().unwrap()
        ));
        for name in [
            "x-goog-api-key",
            "user-agent",
            "x-goog-api-client",
            "content-type",
        ] {
            req = req.header(name, r["headers"][name].as_str().unwrap());
        }
        let resp = support::within(req.body(r["body"].to_string()).send())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "request {i}");
        let text = support::within(resp.text()).await.unwrap();
        let expected = ["functionCall", "It says hello world."][i];
        assert!(
            text.starts_with("data: ") && text.contains(expected),
            "{text}"
        );

        let got = h.fake.last().unwrap();
        assert_eq!(
            got.path,
            "/v1/models/gemini-2.5-flash:streamGenerateContent"
        );
        assert_eq!(got.query.as_deref(), Some("alt=sse"));
        assert_eq!(
            got.headers.get("x-goog-api-key").unwrap(),
            r["headers"]["x-goog-api-key"].as_str().unwrap()
        );
        let sent = got.json();
        assert_eq!(sent["contents"], r["body"]["contents"], "request {i}");
        assert_eq!(sent["systemInstruction"], r["body"]["systemInstruction"]);
        assert_eq!(sent["generationConfig"], r["body"]["generationConfig"]);
    }
    h.wait_exchanges(2).await;
    assert_eq!(
        number(
            &*h.sql(),
            "SELECT count(DISTINCT conversation_id) FROM exchanges"
        ),
        1,
        "the tool call's result continues the turn's conversation"
    );
}

/// With the proxy set to observe, `connect gemini-cli` puts Gemini CLI's
/// own compression at half the proxy's window: the real CLI compresses
/// once a prompt reported past that, not before, with the model written
/// for it (not gemini-3-pro-preview, its choice for a name it does not
/// know), and the proxy forwards all of it as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Gemini CLI: run scripts/test"]
async fn gemini_cli_compresses_by_itself_at_half_the_window_when_the_proxy_observes() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.mode = compactor::config::Mode::Observe;
    })
    .await;
    let gemini = Gemini::connect_with(&h, "[compaction]\nmode = \"observe\"\n").await;
    let share = gemini.settings()["model"]["compressionThreshold"]
        .as_f64()
        .unwrap();
    let point = (share * ASSUMED).round() as u64;
    assert_eq!(point, WINDOW / 2);

    // Turn 1: a long answer. A resumed session starts from Gemini CLI's
    // own estimate of its history (no system prompt, no tools), so what
    // it compares with the point is a prompt reported within a process:
    // turn 2 is a tool loop, its first call reported under the point, its
    // second past it.
    h.fake.push(sse(long_parts(1), 5_000));
    let out = gemini.first("turn 1: what does the parser do next?").await;
    expect_ok("turn 1", &out);
    // Its compression's two calls, when they come, then the turn's end.
    push_compressing_turn(&h.fake, point, "Answer 2: done.");
    let out = gemini.next("turn 2: read the notes twice").await;
    expect_ok("turn 2", &out);
    assert!(out.stdout.contains("Answer 2: done."), "{}", out.describe());

    // Gemini CLI compressed once, after the prompt reported past the point
    // and before the request that followed it: a summary and a check of
    // it, each a generateContent call.
    let received = h.fake.received();
    let stream_at: Vec<usize> = (0..received.len())
        .filter(|&i| received[i].path.ends_with(":streamGenerateContent"))
        .collect();
    assert_eq!(stream_at.len(), 4, "turn 1, then turn 2's three requests");
    let own: Vec<usize> = (0..received.len())
        .filter(|&i| received[i].path.ends_with(":generateContent"))
        .collect();
    assert_eq!(own.len(), 2, "a summary and its check");
    assert!(
        own.iter().all(|&i| stream_at[2] < i && i < stream_at[3]),
        "after the prompt past the point, not after the one under it: {own:?} {stream_at:?}"
    );
    for &i in &own {
        let r = &received[i];
        assert_eq!(r.path, format!("/v1/models/{MODEL}:generateContent"));
        assert!(
            r.json().to_string().contains("state_snapshot"),
            "its compression prompt"
        );
    }
    let last = turns(&h.fake).pop().unwrap().json();
    let sent = texts(&last);
    assert!(
        sent.iter()
            .any(|t| t.contains("Got it. Thanks for the additional context!")),
        "turn 2 went on with Gemini CLI's summary: {sent:?}"
    );
    assert!(
        !sent.iter().any(|t| t.contains("Answer 1: ")),
        "turn 1's answer was compressed away"
    );
    // The proxy only observed: nothing of its own reached the upstream.
    assert!(!h.fake.received().iter().any(is_summary_call));
    assert!(!has_summary(&last));
}

/// In auto mode, what Gemini CLI's own compression left out of the trail
/// follows its snapshot: the real CLI, told a rule in turn 2, compresses
/// turns 1 and 2 away in turn 3, and the upstream gets the snapshot it
/// goes on from with the rule appended, in the conversation of the check whose
/// answer that snapshot is (Gemini CLI names no session). The turns before
/// the compression run no tool: Gemini CLI 0.61 resumes a session whose history holds function
/// calls with each function response twice, which the API refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Gemini CLI: run scripts/test"]
async fn the_trail_gemini_clis_own_compression_left_out_follows_its_snapshot() {
    let h = Harness::start_with(small_window).await;
    let gemini = Gemini::connect(&h).await;
    // In auto mode `connect` puts Gemini CLI's compression past the
    // proxy's window (the proxy compacts first); a user's own threshold
    // puts it at half the window, under the proxy's trigger.
    let point = WINDOW / 2;
    let mut settings = gemini.settings();
    settings["model"]["compressionThreshold"] = json!(point as f64 / ASSUMED);
    let path = gemini.home.path().join(".gemini/settings.json");
    std::fs::write(path, settings.to_string()).unwrap();
    // Turn 1, the task; turn 2, a rule (what the user types after the
    // task), under the point.
    h.fake.push(sse(long_parts(1), 5_000));
    let out = gemini.first("turn 1: what does the parser do next?").await;
    expect_ok("turn 1", &out);
    h.fake.push(sse(long_parts(2), 6_500));
    let out = gemini.next("From now on, never push to main.").await;
    expect_ok("turn 2", &out);
    // Turn 3: past the point, then its compression of turns 1 and 2 (a
    // snapshot that says nothing of the rule, the same again on its
    // check), then the end.
    push_compressing_turn(&h.fake, point, "Answer 3: done.");
    let out = gemini.next("turn 3: read the notes twice").await;
    expect_ok("turn 3", &out);

    let last = turns(&h.fake).pop().unwrap().json();
    // Its context and the snapshot, two parts of its first content, then
    // the trail appended.
    let parts = contents(&last)[0]["parts"].as_array().unwrap();
    assert_eq!(parts[1]["text"], SNAPSHOT, "{:?}", texts(&last));
    let block = parts
        .get(2)
        .and_then(|p| p["text"].as_str())
        .unwrap_or_else(|| panic!("the trail appended: {parts:?}"));
    assert!(block.starts_with(HANDOFF_NOTE), "{block}");
    assert!(block.contains("never push to main"), "{block}");
    // The request after the compression is of the conversation of its
    // check, the exchange before it (its compression's first call and the
    // turns before went elsewhere: the check shares no answer with them).
    let rows = h
        .sql()
        .rows("SELECT conversation_id FROM exchanges ORDER BY id", &[])
        .unwrap();
    let conversations: Vec<String> = rows.iter().map(|r| r.get(0).unwrap()).collect();
    let [.., turn, asked, checked, went_on] = conversations.as_slice() else {
        panic!("{conversations:?}")
    };
    assert_eq!(went_on, checked, "{conversations:?}");
    assert!(went_on != asked && went_on != turn, "{conversations:?}");
}
