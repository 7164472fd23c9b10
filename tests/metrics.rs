//! `GET /metrics` through a real proxy: the exposition format, and the
//! counters the request path and the compaction engine feed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use serde_json::json;
use support::{client, post, small_window, within, Harness};

const KEY: &str = "sk-metrics-tests";

async fn scrape(h: &Harness) -> (u16, String, String) {
    let resp = within(client().get(format!("http://{}/metrics", h.addr)).send())
        .await
        .expect("scrape");
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (status, ct, within(resp.text()).await.expect("body"))
}

/// The value of the sample named exactly `series` (name plus labels as rendered).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Scrapes until `series` reaches at least `min` (counters may be bumped
/// just after the client has its answer), returning the last exposition.
async fn scrape_until(h: &Harness, series: &str, min: f64) -> String {
    let mut text = String::new();
    for _ in 0..100 {
        text = scrape(h).await.2;
        if sample(&text, series).is_some_and(|v| v >= min) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    text
}

async fn chat(h: &Harness, history: &[serde_json::Value], model: &str) -> u16 {
    post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &json!({"model": model, "messages": history}),
    )
    .await
    .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_prometheus_text_with_help_and_type() {
    let h = Harness::start().await;
    let (status, ct, text) = scrape(&h).await;
    assert_eq!(status, 200);
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    for (name, kind) in [
        ("compactor_requests_total", "counter"),
        ("compactor_upstream_latency_seconds", "histogram"),
        ("compactor_ttfb_seconds", "histogram"),
        ("compactor_compactions_total", "counter"),
        ("compactor_compaction_tokens_saved_total", "counter"),
        ("compactor_summary_failures_total", "counter"),
        ("compactor_summary_fallbacks_total", "counter"),
        ("compactor_reactive_retries_total", "counter"),
        ("compactor_compaction_storms_avoided_total", "counter"),
        ("compactor_client_compaction_repeats_total", "counter"),
        ("compactor_summaries_appended_total", "counter"),
        ("compactor_summaries_rewritten_total", "counter"),
        ("compactor_store_bytes", "gauge"),
        ("compactor_active_conversations", "gauge"),
        ("compactor_compactions_stored", "gauge"),
        ("compactor_build_info", "gauge"),
        ("compactor_summary_calls_total", "counter"),
        ("compactor_summary_tokens_total", "counter"),
        ("compactor_summary_output_tokens_total", "counter"),
        ("compactor_input_tokens_total", "counter"),
        ("compactor_unfittable_total", "counter"),
        // Named before any model is seen: a family without series yet.
        ("compactor_model_context_window", "gauge"),
    ] {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "HELP {name}:\n{text}"
        );
        assert!(
            text.contains(&format!("# TYPE {name} {kind}\n")),
            "TYPE {name}:\n{text}"
        );
    }
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(line.starts_with("compactor_"), "{line}");
        let value = line.rsplit(' ').next().unwrap();
        assert!(
            value == "+Inf" || value.parse::<f64>().is_ok(),
            "value of {line}"
        );
    }
    assert!(
        sample(&text, "compactor_store_bytes").unwrap() > 0.0,
        "the store is on disk"
    );
    assert_eq!(sample(&text, "compactor_compactions_stored"), Some(0.0));
    assert_eq!(
        sample(
            &text,
            "compactor_upstream_latency_seconds_bucket{le=\"+Inf\"}"
        ),
        sample(&text, "compactor_upstream_latency_seconds_count"),
    );
}

/// Needs the request path to call `Metrics::request`, `upstream_latency`,
/// `ttfb` and `conversation_seen`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_counted_by_endpoint_and_status() {
    let h = Harness::start().await;
    let mut history = vec![json!({"role": "system", "content": "Be brief."})];
    const N: usize = 3;
    for i in 0..N {
        history.push(json!({"role": "user", "content": format!("question {i}")}));
        assert_eq!(chat(&h, &history, "gpt-4o-mini").await, 200);
        history.push(json!({"role": "assistant", "content": "answer"}));
    }
    let resp = within(
        client()
            .get(format!("{}/models", h.url()))
            .header("authorization", format!("Bearer {KEY}"))
            .send(),
    )
    .await
    .expect("passthrough");
    assert_eq!(resp.status(), 200);

    let chat_ok = "compactor_requests_total{endpoint=\"chat\",status=\"200\"}";
    let text = scrape_until(&h, chat_ok, N as f64).await;
    assert_eq!(sample(&text, chat_ok), Some(N as f64), "{text}");
    let pass = "compactor_requests_total{endpoint=\"passthrough\",status=\"200\"}";
    let text = scrape_until(&h, pass, 1.0).await;
    assert_eq!(sample(&text, pass), Some(1.0), "{text}");
    assert!(
        sample(&text, "compactor_upstream_latency_seconds_count").unwrap_or(0.0) >= N as f64,
        "{text}"
    );
    assert!(
        sample(&text, "compactor_ttfb_seconds_count").unwrap_or(0.0) >= N as f64,
        "{text}"
    );
    assert_eq!(
        sample(&text, "compactor_active_conversations"),
        Some(1.0),
        "one conversation:\n{text}"
    );
}

/// Needs the engine to call `Metrics::compaction` when it stores one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compactions_are_counted_by_rung_and_reason() {
    let h = Harness::start_with(small_window).await;
    let mut history = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": "TASK: refactor the parser so that it streams."}),
    ];
    let stored = "compactor_compactions_stored";
    let mut turns = 0;
    loop {
        history.push(json!({"role": "user", "content": format!(
            "Step {turns}: read src/module_{turns}.rs and report. {}",
            "sit amet consectetur adipiscing elit ".repeat(22)
        )}));
        assert_eq!(chat(&h, &history, "tiny-test").await, 200);
        history.push(json!({"role": "assistant", "content": "Done."}));
        turns += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if sample(&scrape(&h).await.2, stored).is_some_and(|v| v >= 1.0) {
            break;
        }
        assert!(turns < 40, "never compacted");
    }
    let text = scrape(&h).await.2;
    let threshold: f64 = ["truncate", "prune", "summary", "fallback"]
        .iter()
        .filter_map(|r| {
            sample(
                &text,
                &format!("compactor_compactions_total{{rung=\"{r}\",reason=\"threshold\"}}"),
            )
        })
        .sum();
    assert!(threshold >= 1.0, "{text}");
    let saved: f64 = ["truncate", "prune", "summary", "fallback"]
        .iter()
        .filter_map(|r| {
            sample(
                &text,
                &format!("compactor_compaction_tokens_saved_total{{rung=\"{r}\"}}"),
            )
        })
        .sum();
    assert!(saved > 0.0, "{text}");
}
