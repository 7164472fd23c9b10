//! Small holes, each through real sockets or the real binary: readiness
//! probes behind a hanging upstream, the doctor's deadline and its database
//! check, terminal control sequences in what the CLI prints, a malformed
//! chunked body, a non-ASCII conversation id, the client's bytes kept
//! when the proxy takes its metadata key out, and a conversation's next
//! request sent the moment a stream that crossed the trigger ended.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{cli, client, post_raw, raw_upstream, read_request, within, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "sk-holes";

/// An upstream that reads requests and never answers one.
async fn hanging_upstream() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    raw_upstream(|_, mut s, count| async move {
        let mut buf = Vec::new();
        while read_request(&mut s, &mut buf).await.is_some() {
            count.fetch_add(1, Ordering::SeqCst);
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readiness_probes_behind_a_hanging_upstream_share_one_probe() {
    let (url, asked) = hanging_upstream().await;
    let h = Harness::start_with(|c| c.upstream.base_url = url).await;
    let started = Instant::now();
    let probes: Vec<_> = (0..8)
        .map(|_| {
            let url = format!("http://{}/readyz", h.addr);
            tokio::spawn(async move {
                let resp = client().get(url).send().await.expect("readyz");
                let status = resp.status().as_u16();
                let body: Value = resp.json().await.unwrap_or(Value::Null);
                (status, body, started.elapsed())
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for probe in probes {
        let (status, body, took) = within(probe).await.expect("join");
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["checks"]["upstream"]["ok"], false, "{body}");
        slowest = slowest.max(took);
    }
    // One probe's timeout (2 s) for all of them, not eight in a row.
    assert!(
        slowest < Duration::from_secs(5),
        "slowest probe {slowest:?}"
    );
    assert_eq!(
        asked.load(Ordering::SeqCst),
        1,
        "the upstream was asked once"
    );
}

/// An upstream that lists `n` models and never answers `/props`.
async fn upstream_hanging_on_props(n: usize) -> String {
    let models: Vec<Value> = (0..n)
        .map(|i| json!({"id": format!("model-{i}"), "object": "model"}))
        .collect();
    let listing = json!({"object": "list", "data": models}).to_string();
    let (url, _) = raw_upstream(move |_, mut s, _| {
        let listing = listing.clone();
        async move {
            let mut buf = Vec::new();
            while let Some(req) = read_request(&mut s, &mut buf).await {
                if !req.starts_with(b"GET /v1/models") {
                    // Holds the connection: the answer never comes.
                    tokio::time::sleep(Duration::from_secs(120)).await;
                    return;
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{listing}",
                    listing.len()
                );
                if s.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_asks_every_model_under_one_deadline_and_warns_of_timeouts() {
    let url = upstream_hanging_on_props(20).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let started = Instant::now();
    let (code, out, err) = cli(
        &["doctor", "--upstream", &url, "--db", db.to_str().unwrap()],
        &[("OPENAI_API_KEY", "")],
    )
    .await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(15), "took {took:?}: {out}{err}");
    assert_eq!(code, 0, "a timeout is no failure: {code} {out}{err}");
    let windows: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" model model-"))
        .collect();
    assert_eq!(windows.len(), 20, "{out}");
    for line in windows {
        assert!(line.starts_with('!'), "a timeout is no pass: {line}");
        assert!(line.contains("did not say"), "{line}");
    }
    assert!(out.contains("0 failed, 20 to look at"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_a_postgres_store_and_fails_when_it_cannot_be_reached() {
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let (code, out, err) = cli(
        &[
            "doctor",
            "--upstream",
            &fake.url(),
            "--database-url",
            "postgres://app@127.0.0.1:1/records?password=pw-not-shown",
        ],
        &[("OPENAI_API_KEY", "")],
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("✗ database:"))
        .unwrap_or_else(|| panic!("no database line: {out}"));
    assert!(line.contains("127.0.0.1:1/records"), "{line}");
    assert!(!out.contains("pw-not-shown"), "{out}");
    assert!(out.contains("1 failed"), "{out}");
    assert!(!out.contains("✓ store"), "no SQLite file is checked: {out}");
}

const HOSTILE: &str = "\u{1b}]0;owned\u{7}hi \u{1b}[2J\u{9b}31m \u{202e}txt.exe\u{7f}";

fn assert_terminal_safe(what: &str, out: &str) {
    for ch in ['\u{1b}', '\u{7}', '\u{9b}', '\u{202e}', '\u{7f}'] {
        assert!(!out.contains(ch), "{what} prints {ch:?} raw: {out:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_escapes_control_and_bidi_characters_of_client_strings() {
    let h = Harness::start().await;
    let body = json!({"model": format!("m{HOSTILE}"), "messages": [
        {"role": "user", "content": HOSTILE}]});
    let (status, headers, _) = post_raw(
        &format!("{}/chat/completions", h.url()),
        KEY,
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let id = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    h.wait_exchanges(1).await;
    let db = h.db.to_str().unwrap().to_string();
    let (code, list, err) = cli(&["conversations", "list", "--db", &db], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert!(list.contains(&id), "{list}");
    assert_terminal_safe("conversations list", &list);
    assert!(list.contains("\\u{1b}"), "shown escaped: {list}");
    for args in [
        vec!["conversations", "show", &id, "--db", &db],
        vec!["conversations", "list", "--json", "--db", &db],
        vec!["conversations", "show", &id, "--json", "--db", &db],
    ] {
        let (code, out, err) = cli(&args, &[]).await;
        assert_eq!(code, 0, "{args:?}: {err}");
        assert_terminal_safe(&format!("{args:?}"), &out);
    }
    // Export stays lossless: the same characters, as JSON escapes.
    let (code, export, err) = cli(&["conversations", "export", &id, "--db", &db], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert_terminal_safe("conversations export", &export);
    assert!(export.contains("\\u202e"), "{export}");
    let parsed: Value = serde_json::from_str(&export).expect("export is JSON");
    assert_eq!(
        parsed["original_items"][0]["content"], HOSTILE,
        "the export keeps the client's text"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunked_body_on_a_relayed_path_is_the_clients_400() {
    let h = Harness::start().await;
    let mut s = within(TcpStream::connect(h.addr)).await.unwrap();
    let request = "POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-c\r\n\
                   content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
                   5\r\n{\"a\":\r\nzz-not-a-size\r\n\r\n";
    within(s.write_all(request.as_bytes())).await.unwrap();
    let mut answer = Vec::new();
    let _ = within(s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    let status: u16 = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {answer}"));
    assert_eq!(status, 400, "{answer}");
    assert!(!answer.contains("upstream_unreachable"), "{answer}");
    // The proxy still serves.
    let (status, _, _) = post_raw(
        &format!("{}/chat/completions", h.url()),
        KEY,
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 200);
}

/// Sends a chat request with the raw header value `id` (bytes as given).
async fn with_conversation_header(h: &Harness, id: &[u8], text: &str) -> (u16, String, Value) {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string();
    let mut head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\
         content-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\
         x-compactor-conversation: ",
        body.len()
    )
    .into_bytes();
    head.extend_from_slice(id);
    head.extend_from_slice(b"\r\n\r\n");
    head.extend_from_slice(body.as_bytes());
    let mut s = within(TcpStream::connect(h.addr)).await.unwrap();
    within(s.write_all(&head)).await.unwrap();
    let mut answer = Vec::new();
    within(s.read_to_end(&mut answer)).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let conversation = answer
        .lines()
        .find_map(|l| l.strip_prefix("x-compactor-conversation: "))
        .unwrap_or_default()
        .to_string();
    let body = answer.find("\r\n\r\n").map_or("", |i| &answer[i + 4..]);
    (
        status,
        conversation,
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_utf8_conversation_header_names_one_conversation_and_other_bytes_get_400() {
    let h = Harness::start().await;
    let id = "projet-été-🚀".as_bytes();
    let (s1, c1, _) = with_conversation_header(&h, id, "first, unrelated").await;
    let (s2, c2, _) = with_conversation_header(&h, id, "second, unrelated too").await;
    assert_eq!((s1, s2), (200, 200));
    assert!(!c1.is_empty());
    assert_eq!(c1, c2, "the same id is the same conversation");
    let (status, _, body) = with_conversation_header(&h, b"bad-\xff\xfe", "third").await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "x-compactor-conversation", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taking_out_the_metadata_mode_keeps_every_other_byte_of_the_body() {
    let h = Harness::start().await;
    let rest = r#""messages":[{"role":"user","content":"caf\u00e9 \/ \ud83d\ude80"}],"seed":123456789012345678901234567890,"temperature":1.50"#;
    let raw = format!(r#"{{"model":"m","metadata":{{"compactor_mode":"auto"}},{rest}}}"#);
    let (status, _, _) = post_raw(
        &format!("{}/chat/completions", h.url()),
        KEY,
        raw.clone().into_bytes(),
    )
    .await;
    assert_eq!(status, 200);
    let sent = h.fake.last().expect("sent");
    let sent = String::from_utf8_lossy(&sent.body).into_owned();
    assert_eq!(sent, format!(r#"{{"model":"m",{rest}}}"#));
}

/// A streamed conversation whose next request goes the moment the stream
/// ends, again and again: an existing compaction must cover each request
/// (no fresh hard-limit summary of a conversation a compaction already
/// covers), and no request may fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sent_the_moment_a_stream_ends_use_the_existing_compaction() {
    let h = Harness::start_with(support::small_window).await;
    back_to_back_turns_compact_only_at_the_threshold(&h).await;
}

/// The same with summary calls that take several turns: a job's
/// follow-up then starts from a request sent before the job's own
/// compaction was stored, on an earlier base, and may cover less than
/// the compaction later requests are sent with. A request is not left
/// over the hard limit with nothing under way for that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summaries_that_take_several_turns_leave_no_request_over_the_hard_limit() {
    let h = Harness::start_with(support::small_window).await;
    h.fake.set_summary_delay(Some(Duration::from_millis(12)));
    back_to_back_turns_compact_only_at_the_threshold(&h).await;
}

async fn back_to_back_turns_compact_only_at_the_threshold(h: &Harness) {
    let url = format!("{}/chat/completions", h.url());
    let http = client();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": "TASK: keep a running log of the build."}),
    ];
    let started = Instant::now();
    let mut failures = Vec::new();
    for turn in 0..160 {
        let body = json!({"model": "tiny-test", "stream": true,
            "stream_options": {"include_usage": true}, "messages": messages});
        let resp = within(
            http.post(&url)
                .header("authorization", format!("Bearer {KEY}"))
                .json(&body)
                .send(),
        )
        .await
        .expect("send");
        let status = resp.status().as_u16();
        let text = within(resp.text()).await.expect("the stream");
        if status != 200 {
            failures.push((turn, status, text));
            break;
        }
        let answer: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| {
                v.pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .map(String::from)
            })
            .collect();
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": format!(
            "turn {turn}: the build printed {} and we go on", "warning: unused variable ".repeat(4))}));
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "bounded in time"
        );
    }
    assert!(failures.is_empty(), "{failures:?}");
    let reasons: Vec<String> = support::column(&*h.sql(), "SELECT reason FROM compactions");
    assert!(!reasons.is_empty(), "the conversation compacted");
    let fresh: Vec<&String> = reasons
        .iter()
        .filter(|r| r.starts_with("hard_limit"))
        .collect();
    assert!(
        fresh.is_empty(),
        "{} of {} compactions were fresh hard-limit ones: {reasons:?}",
        fresh.len(),
        reasons.len()
    );
}

/// A user turn of about `tokens` tokens, of plain words (which the
/// estimate and the fake's four bytes a token count alike).
fn long_turn(turn: usize, tokens: usize) -> String {
    let mut text = format!("turn {turn}: the build log follows.");
    while text.len() < tokens * 4 {
        text.push_str(" the build ran one more step and all of it went well");
    }
    text
}

/// Every streamed answer takes the conversation past the trigger, so a
/// background compaction starts at each, and the next request, sent the
/// moment the stream ends, is too large to go without that compaction: it
/// must find it under way (and wait for it) or stored, never compact afresh
/// at the hard limit, 150 times in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_moment_a_stream_crossed_the_trigger_finds_its_compaction() {
    // Between the trigger (5,000) and the hard limit (9,700) there is room
    // for a turn (3,000): each request crosses the trigger, and the next,
    // a turn larger, needs the compaction that started.
    let h = Harness::start_with(|c| {
        c.models.push(compactor::config::ModelConfig {
            pattern: "mid*".into(),
            context_window: 10_000,
            max_output_tokens: Some(300),
            trigger_ratio: Some(0.5),
            ..Default::default()
        })
    })
    .await;
    let url = format!("{}/chat/completions", h.url());
    let http = client();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": long_turn(0, 3000)}),
    ];
    let started = Instant::now();
    let mut failures = Vec::new();
    for turn in 1..=150 {
        let body = json!({"model": "mid-test", "stream": true,
            "stream_options": {"include_usage": true}, "messages": messages});
        let resp = within(
            http.post(&url)
                .header("authorization", format!("Bearer {KEY}"))
                .json(&body)
                .send(),
        )
        .await
        .expect("send");
        let status = resp.status().as_u16();
        let text = within(resp.text()).await.expect("the stream");
        if status != 200 {
            failures.push((turn, status, text));
            break;
        }
        let answer: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| {
                v.pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .map(String::from)
            })
            .collect();
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": long_turn(turn, 3000)}));
        assert!(
            started.elapsed() < Duration::from_secs(400),
            "bounded in time"
        );
    }
    assert!(failures.is_empty(), "{failures:?}");
    let reasons: Vec<String> = support::column(&*h.sql(), "SELECT reason FROM compactions");
    assert!(
        reasons.len() >= 50,
        "most answers started a compaction: {reasons:?}"
    );
    let fresh: Vec<&String> = reasons
        .iter()
        .filter(|r| r.starts_with("hard_limit"))
        .collect();
    if !fresh.is_empty() {
        // What led there: the exchanges and compactions in time order.
        let timeline: Vec<String> = support::column(
            &*h.sql(),
            "SELECT line FROM (\
             SELECT started_ms AS t, started_ms || ' exchange ' || id || ' took ' || latency_ms \
                 || ' ms, input ' || coalesce(input_tokens, -1) || ', sent with ' \
                 || coalesce(compaction_id, '-') AS line FROM exchanges \
             UNION ALL \
             SELECT created_ms AS t, created_ms || ' compaction ' || id || ' of ' \
                 || coalesce(base_id, '-') || ' (' || reason || ', ' || rung || ', ' \
                 || tokens_before || ' -> ' || tokens_after || ', covers ' || covered_len \
                 || ', ' || duration_ms || ' ms)' AS line FROM compactions) AS all_lines \
             ORDER BY t",
        );
        panic!(
            "{} of {} compactions were fresh hard-limit ones: {fresh:?}\n{}",
            fresh.len(),
            reasons.len(),
            timeline.join("\n")
        );
    }
}

const CODEX_COMPACTION: &str =
    r#"{"session_id":"s-1","turn_id":"t-2","request_kind":"compaction"}"#;

/// A Responses history of `turns` long exchanges (~`turns` × 1.1k tokens).
fn codex_history(turns: usize) -> Vec<Value> {
    let mut input = vec![json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "TASK: refactor the parser."}]})];
    for n in 0..turns {
        input.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": format!("Answer {n}: {}", "the lexer hands a token to parse_expr. ".repeat(110))}]}));
        input.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": format!("turn {n}: go on")}]}));
    }
    input
}

/// Posts a Responses request, as Codex marks its own compaction request
/// when `compaction`; returns the status.
async fn post_responses(h: &Harness, input: &[Value], compaction: bool) -> u16 {
    let mut req = client()
        .post(format!("{}/responses", h.url()))
        .header("authorization", format!("Bearer {KEY}"))
        .json(&json!({"model": "tiny-test", "input": input}));
    if compaction {
        req = req.header("x-codex-turn-metadata", CODEX_COMPACTION);
    }
    let resp = within(req.send()).await.expect("send");
    let status = resp.status().as_u16();
    within(resp.bytes()).await.expect("body");
    status
}

fn with_checkpoint_prompt(mut input: Vec<Value>) -> Vec<Value> {
    input.push(
        json!({"type": "message", "role": "user", "content": [{"type": "input_text",
        "text": "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary."}]}),
    );
    input
}

/// Codex's own compaction request goes as Codex sent it when it fits,
/// even where a stored compaction covers its prefix, and past the hard
/// limit it is never compacted afresh: a summary of the proxy's summary is
/// what Codex would keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_compaction_requests_go_as_sent_and_are_never_compacted_afresh() {
    let h = Harness::start_with(support::small_window).await;
    // Crosses the trigger: a stored compaction covers this prefix.
    let history = codex_history(2);
    assert_eq!(post_responses(&h, &history, false).await, 200);
    support::wait_compactions(&h, 1).await;
    let request = with_checkpoint_prompt(history.clone());
    assert_eq!(post_responses(&h, &request, true).await, 200);
    let sent = h.fake.last().expect("sent").json();
    assert_eq!(sent["input"], json!(request), "as Codex sent it");

    // Past the hard limit with no stored compaction for it: as it is, and
    // no fresh compaction.
    let h = Harness::start_with(support::small_window_foreground).await;
    let request = with_checkpoint_prompt(codex_history(3));
    assert_eq!(post_responses(&h, &request, true).await, 200);
    assert_eq!(support::compactions(&h), 0, "no fresh compaction");
    assert_eq!(h.fake.last().expect("sent").json()["input"], json!(request));
}
