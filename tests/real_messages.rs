//! The real tier of Anthropic Messages: compactor in front of a real
//! llama.cpp server's `/v1/messages` (SmolLM2-135M, 2048-token context)
//! started by `scripts/test`, which exports its base URL as
//! `COMPACTOR_LLAMA_URL`.
//!
//! What llama.cpp does on this endpoint, as these tests rely on it: usage
//! is `input_tokens` (the part not served from its prompt cache) and
//! `cache_read_input_tokens` (no `cache_creation_input_tokens`), in JSON and
//! in the stream's `message_start`, with `message_delta` carrying the output
//! tokens; a prompt over the window is refused before any stream starts
//! with its OpenAI-shaped `exceed_context_size_error` (`request (N tokens)
//! exceeds the available context size (W tokens)`), not Anthropic's
//! wording.
//!
//! Every test is `#[ignore]`d so a bare `cargo test` stays offline; the
//! project's test command runs them with `--include-ignored`. Generations
//! are kept to a few tokens; the server has one slot, so the tests take
//! turns.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{column, number, Harness};

/// llama-server runs one slot: the tests take turns, so a long summary call
/// of one never eats another's step timeout.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const KEY: &str = "sk-ant-real-messages-test";
const MODEL: &str = "smollm2";
const LLAMA_WINDOW: u64 = 2048;
/// Per-request cap: a request may queue behind a summary call (several
/// seconds on 2 cores).
const LONG_STEP: Duration = Duration::from_secs(180);

/// The llama-server base URL (with `/v1`), or a panic saying how to get one.
fn llama_url() -> String {
    match std::env::var("COMPACTOR_LLAMA_URL") {
        Ok(u) if !u.trim().is_empty() => u.trim().trim_end_matches('/').to_string(),
        _ => panic!(
            "COMPACTOR_LLAMA_URL is not set: these tests need a real llama-server. \
             Run `scripts/test` (it starts one and sets the variable), or start one with \
             `scripts/llama-server.sh start 18931 2048` and export \
             COMPACTOR_LLAMA_URL=http://127.0.0.1:18931/v1"
        ),
    }
}

/// POSTs a Messages request as the Anthropic SDKs do; returns status,
/// headers and the whole body.
async fn send(url: &str, body: &Value) -> (u16, http::HeaderMap, bytes::Bytes) {
    let request = async {
        let resp = support::client()
            .post(url)
            .header("x-api-key", KEY)
            .header("anthropic-version", "2023-06-01")
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("POST {url} body: {e}"));
        (status, headers, bytes)
    };
    tokio::time::timeout(LONG_STEP, request)
        .await
        .unwrap_or_else(|_| panic!("POST {url}: no answer within {LONG_STEP:?}"))
}

fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

/// SSE events as (event name, data JSON), in order.
fn events(body: &[u8]) -> Vec<(String, Value)> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut name = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        if !data.is_empty() {
            out.push((name, json_of(data.as_bytes())));
        }
    }
    out
}

/// The prompt's size as this endpoint reports it: the input, the part read
/// from the cache, and the part written to it.
fn prompt_of(usage: &Value) -> i64 {
    [
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ]
    .iter()
    .map(|k| usage[*k].as_i64().unwrap_or(0))
    .sum()
}

/// The assistant message of an answer as a client keeps it: the content
/// received, or the text the stream's deltas spelled.
fn assistant_of(body: &[u8], streamed: bool) -> Value {
    if !streamed {
        let v = json_of(body);
        assert_eq!(v["type"], "message", "{v}");
        return json!({"role": "assistant", "content": v["content"]});
    }
    let evs = events(body);
    assert_eq!(
        evs.last().map(|e| e.0.as_str()),
        Some("message_stop"),
        "the stream ends with message_stop: {}",
        String::from_utf8_lossy(body)
    );
    let text: String = evs
        .iter()
        .filter(|(name, _)| name == "content_block_delta")
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    // An empty generation still needs a non-empty block to be sent back.
    let text = if text.trim().is_empty() {
        "(no answer)".to_string()
    } else {
        text
    };
    json!({"role": "assistant", "content": [{"type": "text", "text": text}]})
}

fn is_exceed_context(status: u16, body: &[u8]) -> bool {
    status == 400
        && serde_json::from_slice::<Value>(body)
            .is_ok_and(|v| v["error"]["type"] == "exceed_context_size_error")
}

/// The latest exchange's recorded (input, output, cached) tokens.
fn last_usage(h: &Harness) -> (i64, i64, i64) {
    let rows = h
        .sql()
        .rows(
            "SELECT input_tokens, output_tokens, cached_tokens FROM exchanges ORDER BY id DESC LIMIT 1",
            &[],
        )
        .expect("exchanges");
    (
        rows[0].get(0).expect("input_tokens"),
        rows[0].get(1).expect("output_tokens"),
        rows[0].get(2).expect("cached_tokens"),
    )
}

/// JSON and SSE answers of llama.cpp's `/v1/messages` reach the client as
/// they came, and the record holds the usage they reported: the prompt as
/// input + cache read (+ cache creation), the cached part apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn messages_json_and_sse_usage_is_read_and_recorded() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let upstream = llama_url();
    let h = Harness::start_with(move |c| c.upstream.base_url = upstream).await;
    let url = format!("{}/messages", h.url());
    let body = json!({"model": MODEL, "max_tokens": 5, "temperature": 0.0,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": "Say hello to the ledger team, please."}]});

    // The same request twice: the second reads its prompt from llama.cpp's
    // cache, and reports that part apart.
    let mut seen = Vec::new();
    for _ in 0..2 {
        let (status, headers, bytes) = send(&url, &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        assert!(headers.get("x-compactor-conversation").is_some());
        let v = json_of(&bytes);
        assert_eq!(v["type"], "message", "{v}");
        assert!(v["content"][0]["text"].is_string(), "{v}");
        let u = v["usage"].clone();
        h.wait_exchanges(seen.len() as i64 + 1).await;
        let (input, output, cached) = last_usage(&h);
        assert_eq!(input, prompt_of(&u), "input + cache figures: {u}");
        assert_eq!(output, u["output_tokens"].as_i64().unwrap(), "{u}");
        assert_eq!(
            cached,
            u["cache_read_input_tokens"].as_i64().unwrap_or(0),
            "{u}"
        );
        seen.push(u);
    }
    eprintln!(
        "llama.cpp /v1/messages JSON usage: {} then {}",
        seen[0], seen[1]
    );
    assert!(
        seen[1]["cache_read_input_tokens"].as_i64().unwrap_or(0) > 0,
        "the repeated prompt was read from the cache: {}",
        seen[1]
    );

    // A stream: usage from `message_start` and the cumulative
    // `message_delta`.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, headers, bytes) = send(&url, &streamed).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let evs = events(&bytes);
    assert_eq!(evs[0].0, "message_start", "{evs:?}");
    let start = evs[0].1["message"]["usage"].clone();
    let delta = evs
        .iter()
        .rev()
        .find(|(n, _)| n == "message_delta")
        .map(|(_, d)| d["usage"].clone())
        .expect("message_delta");
    eprintln!("llama.cpp /v1/messages stream usage: message_start {start}, message_delta {delta}");
    assistant_of(&bytes, true);
    h.wait_exchanges(3).await;
    let (input, output, cached) = last_usage(&h);
    assert_eq!(input, prompt_of(&start), "{start}");
    assert_eq!(output, delta["output_tokens"].as_i64().unwrap(), "{delta}");
    assert_eq!(
        cached,
        start["cache_read_input_tokens"].as_i64().unwrap_or(0)
    );
    let endpoints: Vec<String> = column(&*h.sql(), "SELECT endpoint FROM exchanges");
    assert!(endpoints.iter().all(|e| e == "/messages"), "{endpoints:?}");
}

/// A user turn of ~90 tokens: a coding agent's report, different each time.
fn turn_text(i: usize) -> String {
    const FILES: [&str; 6] = [
        "src/ledger/posting.rs",
        "src/ledger/balance.rs",
        "src/import/csv.rs",
        "tests/reconcile.rs",
        "src/report/monthly.rs",
        "Cargo.toml",
    ];
    const OUTPUTS: [&str; 5] = [
        "error[E0599]: no method named `settle` found for struct `Posting` in the current scope",
        "thread 'reconcile_march' panicked at tests/reconcile.rs:88:5: balances differ by 0.01",
        "warning: unused import: `std::collections::BTreeMap` --> src/report/monthly.rs:3:5",
        "test result: FAILED. 17 passed; 2 failed; 0 ignored; finished in 0.21s",
        "error[E0308]: mismatched types: expected `Decimal`, found `f64`",
    ];
    format!(
        "Step {i}: I edited {} to round postings with banker's rounding, then ran \
         `cargo test --test reconcile -- --nocapture`, which printed: {}. \
         What should I look at next? Answer in one short sentence.",
        FILES[i % FILES.len()],
        OUTPUTS[(i * 3 + 1) % OUTPUTS.len()]
    )
}

const TASK: &str = "TASK: make the ledger reconcile: every month's closing balance must \
equal the next month's opening balance, amounts are Decimal, never f64, and the public \
function `reconcile(ledger: &Ledger) -> Result<Report, Mismatch>` keeps its signature. \
Answer briefly: one short sentence per turn.";
const TURNS: usize = 25;
const TURN_MAX_TOKENS: u64 = 16;

fn turn_request(history: &[Value], streamed: bool) -> Value {
    json!({"model": MODEL, "max_tokens": TURN_MAX_TOKENS, "temperature": 0.0,
        "system": "You are a careful coding agent. Answer in one short sentence.",
        "messages": history, "stream": streamed})
}

fn user(i: usize) -> Value {
    let text = if i == 0 {
        TASK.to_string()
    } else {
        turn_text(i)
    };
    json!({"role": "user", "content": [{"type": "text", "text": text}]})
}

/// The acceptance test on this endpoint: 25 turns that outgrow the
/// 2048-token window complete through compactor with no error reaching the
/// client, while the same conversation sent direct is refused with
/// `exceed_context_size_error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn twenty_five_turns_fit_through_compactor_but_overflow_direct() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let started = std::time::Instant::now();
    // Every fourth turn is streamed.
    let streamed = |i: usize| i % 4 == 3;

    // 1. Direct: the growing conversation overflows the window.
    let direct_url = format!("{}/messages", llama_url());
    let mut direct = Vec::new();
    let mut overflow_at = None;
    for i in 0..TURNS {
        direct.push(user(i));
        let s = streamed(i);
        let (status, _, body) = send(&direct_url, &turn_request(&direct, s)).await;
        if is_exceed_context(status, &body) {
            eprintln!(
                "direct: turn {} refused: {}",
                i + 1,
                String::from_utf8_lossy(&body)
            );
            overflow_at = Some(i + 1);
            break;
        }
        assert_eq!(
            status,
            200,
            "direct turn {}: {}",
            i + 1,
            String::from_utf8_lossy(&body)
        );
        direct.push(assistant_of(&body, s));
    }
    let overflow_at = overflow_at.unwrap_or_else(|| {
        panic!("the conversation sent direct never overflowed in {TURNS} turns")
    });
    let direct_secs = started.elapsed().as_secs_f64();

    // 2. Through compactor, the window in the models table: every turn
    // succeeds.
    let upstream = llama_url();
    let h = Harness::start_with(move |c| {
        c.upstream.base_url = upstream;
        // No summarizer call: SmolLM2 rarely writes the summary's
        // sections, and each attempt holds the server's one slot for tens
        // of seconds (minutes on a loaded machine) while the next turn
        // waits. The summaries are the facts the proxy extracts itself.
        c.compaction.max_summary_calls = 0;
        c.models.push(compactor::config::ModelConfig {
            pattern: MODEL.into(),
            context_window: LLAMA_WINDOW,
            max_output_tokens: Some(64),
            trigger_ratio: None,
            ..Default::default()
        });
    })
    .await;
    let url = format!("{}/messages", h.url());
    let mut history = Vec::new();
    let mut failures = Vec::new();
    let mut conversations = std::collections::BTreeSet::new();
    let mut compacted_turns = 0;
    for i in 0..TURNS {
        history.push(user(i));
        let s = streamed(i);
        let t = std::time::Instant::now();
        let (status, headers, body) = send(&url, &turn_request(&history, s)).await;
        let compacted = headers.get("x-compactor-compacted").is_some();
        compacted_turns += usize::from(compacted);
        if let Some(c) = headers.get("x-compactor-conversation") {
            conversations.insert(c.to_str().unwrap_or_default().to_string());
        }
        eprintln!(
            "proxy: turn {:2} {} status {status} in {:.1}s, {} messages held, compacted: {compacted}",
            i + 1,
            if s { "stream" } else { "json  " },
            t.elapsed().as_secs_f64(),
            history.len(),
        );
        if status != 200 {
            failures.push(format!(
                "turn {}: {status} {}",
                i + 1,
                String::from_utf8_lossy(&body)
            ));
            break;
        }
        history.push(assistant_of(&body, s));
    }
    // The exact conversation the client now holds does not fit the window.
    let mut full = turn_request(&history, false);
    full["max_tokens"] = json!(1);
    let (direct_status, _, direct_body) = send(&direct_url, &full).await;
    h.wait_exchanges(TURNS as i64).await;
    let compactions = support::compactions(&h);
    let max_input = number(
        &*h.sql(),
        "SELECT max(input_tokens) FROM exchanges WHERE endpoint = '/messages'",
    );
    eprintln!(
        "twenty-five Messages turns: direct overflowed at turn {overflow_at} ({direct_secs:.0}s); \
         through compactor {compacted_turns} turns compacted, {compactions} compactions, \
         max input_tokens {max_input} of {LLAMA_WINDOW}; the final history sent direct: \
         {direct_status}; {:.0}s in all",
        started.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "errors reached the client: {failures:?}"
    );
    assert!(
        is_exceed_context(direct_status, &direct_body),
        "the proxied conversation, sent direct, should not fit: {direct_status} {}",
        String::from_utf8_lossy(&direct_body)
    );
    assert!(
        compactions >= 1,
        "no compaction although the conversation outgrew the window"
    );
    assert!(compacted_turns > 0, "later turns went out compacted");
    assert!(
        max_input < LLAMA_WINDOW as i64,
        "an exchange's input reached the window"
    );
    assert_eq!(
        conversations.len(),
        1,
        "one conversation: {conversations:?}"
    );
}

/// llama.cpp's overflow answer on this endpoint (its own
/// `exceed_context_size_error`, not Anthropic's "prompt is too long") is
/// recognised: a proxy that believes the model's window is the table's
/// 8192 compacts the refused request to the size stated and sends it
/// again, the client sees a 200, and the window is learned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn llama_overflow_wording_on_messages_is_recognised_retried_and_learned() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let upstream = llama_url();
    let h = Harness::start_with(move |c| {
        c.upstream.base_url = upstream;
        c.compaction.background = false;
        // The facts alone, as above: the retry is what is tested here.
        c.compaction.max_summary_calls = 0;
    })
    .await;
    assert_eq!(h.state.model_limits(MODEL).context_window, 8192);
    // A history of ~2600 tokens, built without asking the model: earlier
    // turns with short canned answers.
    let mut history = Vec::new();
    for i in 0..26 {
        history.push(user(i));
        history.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Check the rounding in step {i} next.")}]}));
    }
    history.push(user(26));
    let body = turn_request(&history, false);
    let (status, _, direct) = send(&format!("{}/messages", llama_url()), &body).await;
    assert!(
        is_exceed_context(status, &direct),
        "the request does not fit direct: {status} {}",
        String::from_utf8_lossy(&direct)
    );
    let (status, headers, bytes) = send(&format!("{}/messages", h.url()), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(
        headers.get("x-compactor-compacted").is_some(),
        "{headers:?}"
    );
    assert_eq!(json_of(&bytes)["type"], "message");
    h.wait_exchanges(1).await;
    let windows: Vec<i64> = column(
        &*h.sql(),
        "SELECT context_window FROM exchanges ORDER BY id DESC LIMIT 1",
    );
    assert_eq!(
        windows,
        vec![LLAMA_WINDOW as i64],
        "the stated window is learned"
    );
    assert_eq!(h.state.model_limits(MODEL).context_window, LLAMA_WINDOW);
}
