//! The summary call's cache, on the real llama-server: a conversation
//! whose answer crosses the trigger gets its compaction in the background,
//! and the summary call either repeats the request the upstream just
//! answered with the summary instruction appended (the history a cache
//! read: llama.cpp keeps the slot's KV cache) or, the fallback, sends
//! today's transcript calls (a new prompt). The fallback is forced the way
//! the proxy itself decides it: a `summarizer_model` other than the
//! conversation's cannot share its cache (llama-server answers under any
//! name, so the same model serves both).
//!
//! A router in front of the llama-server records each summary call: its
//! form, latency, the prompt tokens and of those the cached ones
//! (`prompt_tokens_details.cached_tokens`, `timings.cache_n`), the prompt
//! and generation times the server reports. `PROBE_CACHE_RUNS` (default
//! 3) runs of each form, alternated.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compactor::compaction::summary::SUMMARIZER_MARKER;
use compactor::config::{Config, ModelConfig};
use serde_json::{json, Value};

use super::sessions;

/// The proxy's window for the conversation: the llama-server's own
/// (`scripts/llama-server.sh start PORT 8192`).
const WINDOW: u64 = 8_192;
/// The trigger, low enough that the conversation's one answer crosses it
/// while the request and the cached summary call (history, instruction,
/// the summary's answer) still fit the window.
const TRIGGER: f64 = 0.5;
/// How long a background compaction may take (a few summary calls of up
/// to ~1,000 generated tokens each on two shared cores).
const COMPACTION: Duration = Duration::from_secs(600);

/// One summary call as the router saw it.
#[derive(Debug, Clone)]
struct Call {
    /// `cached` (the request repeated, instruction appended) or `transcript`.
    form: &'static str,
    status: u16,
    ms: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    prompt_ms: f64,
    predicted_n: u64,
    predicted_ms: f64,
    /// The body, for the call that repeats the conversation's request.
    sent: Option<Value>,
}

fn form_of(body: &Value) -> &'static str {
    let first_is_summarizer = body["messages"][0]["role"] == "system"
        && body["messages"][0]["content"]
            .as_str()
            .is_some_and(|s| s.contains(SUMMARIZER_MARKER));
    if first_is_summarizer {
        "transcript"
    } else {
        "cached"
    }
}

fn call_of(form: &'static str, status: u16, ms: f64, v: &Value) -> Call {
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let f = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(0.0);
    Call {
        form,
        status,
        ms,
        prompt_tokens: n("/usage/prompt_tokens"),
        cached_tokens: n("/usage/prompt_tokens_details/cached_tokens").max(n("/timings/cache_n")),
        prompt_ms: f("/timings/prompt_ms"),
        predicted_n: n("/timings/predicted_n"),
        predicted_ms: f("/timings/predicted_ms"),
        sent: None,
    }
}

/// A pass-through to `llama` that records every summary call in `calls`;
/// its base URL.
async fn router(llama: String, calls: Arc<Mutex<Vec<Call>>>) -> String {
    sessions::start_router(
        move |_| llama.clone(),
        move |r| {
            if !r.summary {
                return;
            }
            let sent: Value = serde_json::from_slice(r.body).unwrap_or(Value::Null);
            let v: Value = serde_json::from_slice(r.answer).unwrap_or(Value::Null);
            let ms = r.elapsed.as_secs_f64() * 1e3;
            let form = form_of(&sent);
            let mut call = call_of(form, r.status, ms, &v);
            if form == "cached" {
                call.sent = Some(sent);
            }
            calls.lock().expect("calls").push(call);
        },
    )
    .await
}

/// One compaction: the proxy, in front of the router, gets `body`; its
/// answer crosses the trigger and the background compaction runs. The
/// rung and reason it stored, and the summary calls it made.
async fn one(
    llama: &str,
    body: &Value,
    summarizer_model: &str,
) -> (Option<(String, String)>, Vec<Call>, f64) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let upstream = router(llama.to_string(), calls.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("compactor.db");
    let mut config = Config::default();
    config.upstream.base_url = upstream;
    config.upstream.discover_windows = false;
    config.store.path = db.display().to_string();
    config.server.shutdown_grace_secs = 2;
    config.compaction.summarizer_model = summarizer_model.to_string();
    config.models.insert(
        0,
        ModelConfig {
            pattern: sessions::MODEL.into(),
            context_window: WINDOW,
            max_output_tokens: Some(512),
            trigger_ratio: Some(TRIGGER),
            ..Default::default()
        },
    );
    let proxy = sessions::Proxy::start(config).await;
    let addr = proxy.addr;
    let resp = tokio::time::timeout(
        super::CALL,
        reqwest::Client::new()
            .post(format!("http://{addr}/v1/chat/completions"))
            .header("authorization", "Bearer sk-probes")
            .json(body)
            .send(),
    )
    .await
    .expect("request timed out")
    .expect("request");
    let status = resp.status();
    let _ = tokio::time::timeout(super::CALL, resp.bytes()).await;
    assert!(status.is_success(), "the conversation's request: {status}");
    // The background compaction: done when its row is stored.
    let t = Instant::now();
    let row = loop {
        let row =
            rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .ok()
                .and_then(|c| {
                    c.query_row(
                        "SELECT rung, reason FROM compactions ORDER BY rowid DESC LIMIT 1",
                        [],
                        |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
                    )
                    .ok()
                });
        if row.is_some() || t.elapsed() > COMPACTION {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let waited = t.elapsed().as_secs_f64();
    proxy.stop().await;
    let calls = calls.lock().expect("calls").clone();
    (row, calls, waited)
}

/// Runs both forms `PROBE_CACHE_RUNS` times and prints every summary call
/// and the totals per form.
pub async fn run(llama: &str) {
    let scale: f64 = super::env_or("PROBE_CACHE_SCALE", 0.15);
    let runs: usize = super::env_or("PROBE_CACHE_RUNS", 3);
    let session = sessions::trail::trail_sessions(scale)
        .into_iter()
        .next()
        .expect("a trail session");
    // Each compaction's conversation is its own (its system prompt and
    // task name the run): llama.cpp also keeps earlier prompts in host
    // memory, and a transcript an earlier run sent would read as cached.
    let body = |nonce: &str| {
        let mut messages = session.messages.clone();
        for m in messages.iter_mut().take(2) {
            m["content"] = json!(format!("[{nonce}] {}", m["content"].as_str().unwrap_or("")));
        }
        let mut body = json!({
            "model": sessions::MODEL,
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0,
        });
        if !session.tools.is_empty() {
            body["tools"] = json!(session.tools);
        }
        body
    };
    println!(
        "\nthe summary call's cache: {} (scale {scale}, {} tokens by the proxy's count), window {WINDOW}, trigger {TRIGGER}, {runs} runs per form",
        session.name,
        sessions::session_tokens(&session)
    );
    println!(
        "{:<11}{:>4}  {:<10}{:>7}{:>9}{:>9}{:>8}{:>11}{:>9}{:>11}  compaction",
        "form", "run", "call", "status", "ms", "prompt", "cached", "prompt ms", "gen n", "gen ms"
    );
    // (form label, summarizer_model): the same model under another name
    // forces today's transcript calls.
    let forms = [("sharing", ""), ("fallback", "smollm2-other-name")];
    // Per form, each compaction's summary calls and whether its summary
    // was the model's (rung `summary`) or the facts alone (`fallback`).
    let mut done: Vec<Vec<(Vec<Call>, bool)>> = vec![Vec::new(); forms.len()];
    let mut uncached: Vec<Call> = Vec::new();
    for run in 1..=runs {
        for (i, (label, model)) in forms.iter().enumerate() {
            let (row, calls, _) = one(llama, &body(&format!("{label} {run}")), model).await;
            let model_wrote = row.as_ref().is_some_and(|(rung, _)| rung == "summary");
            let shown = row.map_or("none stored".to_string(), |(rung, reason)| {
                format!("{rung}: {reason}")
            });
            for c in &calls {
                println!(
                    "{label:<11}{run:>4}  {:<10}{:>7}{:>9.0}{:>9}{:>8}{:>11.0}{:>9}{:>11.0}  {shown}",
                    c.form, c.status, c.ms, c.prompt_tokens, c.cached_tokens, c.prompt_ms, c.predicted_n, c.predicted_ms
                );
            }
            if calls.is_empty() {
                println!("{label:<11}{run:>4}  (no summary call)  {shown}");
            }
            // The same request with llama.cpp told not to reuse its cache:
            // what the history would cost to read without it (one token
            // generated).
            if let Some(sent) = calls.iter().find_map(|c| c.sent.clone()) {
                let mut cold = sent;
                cold["cache_prompt"] = json!(false);
                cold["max_tokens"] = json!(1);
                let t = Instant::now();
                let client = reqwest::Client::new();
                if let Ok(v) = super::chat(&client, llama, &cold).await {
                    let c = call_of("uncached", 200, t.elapsed().as_secs_f64() * 1e3, &v);
                    println!(
                        "{label:<11}{run:>4}  {:<10}{:>7}{:>9.0}{:>9}{:>8}{:>11.0}{:>9}{:>11.0}  (the cached call again, its cache not used)",
                        c.form, c.status, c.ms, c.prompt_tokens, c.cached_tokens, c.prompt_ms, c.predicted_n, c.predicted_ms
                    );
                    uncached.push(c);
                }
            }
            done[i].push((calls, model_wrote));
        }
    }
    println!("\nper compaction (mean over runs, min–max): its first summary call, and all of them");
    println!(
        "{:<11}{:<7}{:>20}{:>18}{:>18}{:>20}{:>20}{:>8}",
        "form",
        "calls",
        "latency ms",
        "prompt tokens",
        "cached tokens",
        "prompt proc. ms",
        "generation ms",
        "model's"
    );
    // The cached call sent again without its cache, as a third form.
    let cold: Vec<(Vec<Call>, bool)> = uncached.into_iter().map(|c| (vec![c], false)).collect();
    let labels = forms.iter().map(|(l, _)| *l).chain(["uncached"]);
    for (label, runs) in labels.zip(done.iter().chain([&cold])) {
        let wrote = runs.iter().filter(|(_, w)| *w).count();
        let rows: &[(&str, usize)] = if label == "uncached" {
            &[("first", 1)]
        } else {
            &[("first", 1), ("all", usize::MAX)]
        };
        for &(which, take) in rows {
            let col = |f: fn(&Call) -> f64| {
                let v: Vec<f64> = runs
                    .iter()
                    .map(|(calls, _)| calls.iter().take(take).map(f).sum())
                    .collect();
                let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
                let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
                let hi = v.iter().cloned().fold(0.0, f64::max);
                format!("{mean:.0} ({lo:.0}–{hi:.0})")
            };
            println!(
                "{label:<11}{which:<7}{:>20}{:>18}{:>18}{:>20}{:>20}{:>8}",
                col(|c| c.ms),
                col(|c| c.prompt_tokens as f64),
                col(|c| c.cached_tokens as f64),
                col(|c| c.prompt_ms),
                col(|c| c.predicted_ms),
                format!("{wrote}/{}", runs.len())
            );
        }
    }
}
