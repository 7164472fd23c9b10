//! The summary rung through the real proxy with a summarizer that answers
//! in the one-line `LABEL: text` style and leaves sections out: its
//! sections are kept, the retry names the missing ones, the rest is filled
//! from the recorded facts.

mod support;

use serde_json::json;
use support::{post, small_window_foreground, Harness};

const KEY: &str = "sk-summaries-tests";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_one_line_summary_is_kept_and_the_retry_names_what_is_missing() {
    let h = Harness::start_with(small_window_foreground).await;
    h.fake.set_summary_reply(Some(
        "PLAN STATE: port the exporter to UTC, tests next\nDECISIONS: keep the public CSV columns because clients parse them\n"
            .into(),
    ));
    // Text only (no tool output for the cheap rungs to cut), over the
    // tiny model's window: compacted before it goes upstream.
    let mut messages = vec![json!({"role": "user", "content": "Port the exporter to UTC."})];
    for i in 0..24 {
        let role = if i % 2 == 0 { "assistant" } else { "user" };
        let text = format!(
            "turn {i}: {}",
            "the exporter writes local offsets today. ".repeat(20)
        );
        messages.push(json!({"role": role, "content": text}));
    }
    messages.push(json!({"role": "user", "content": "go on"}));
    let url = format!("{}/chat/completions", h.url());
    let (status, headers, _) =
        post(&url, KEY, &json!({"model": "tiny-x", "messages": messages})).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());

    let calls = support::summary_calls(&h);
    assert!(
        calls.len() >= 2,
        "a partial answer is retried: {}",
        calls.len()
    );
    let first = calls[0]["messages"][1]["content"].as_str().unwrap_or("");
    let retry = calls[1]["messages"][1]["content"].as_str().unwrap_or("");
    assert!(!first.contains("lacked these sections"));
    assert!(
        retry.contains("lacked these sections: ## FILE/WORKSPACE STATE, ## CONSTRAINTS & PREFERENCES, ## ERRORS & FIXES, ## OPEN ITEMS / NEXT STEP."),
        "{retry}"
    );

    let (rung, summary): (String, String) = h
        .db()
        .query_row("SELECT rung, summary FROM compactions", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("one compaction");
    assert_eq!(rung, "summary", "the model's sections are used: {summary}");
    assert!(
        summary.contains("## PLAN STATE\nport the exporter to UTC, tests next"),
        "{summary}"
    );
    assert!(
        summary.contains("## DECISIONS\nkeep the public CSV columns because clients parse them"),
        "{summary}"
    );
    assert!(
        summary.contains("## ERRORS & FIXES\n(not provided by the summarizer)"),
        "{summary}"
    );
    assert!(
        summary.contains("## TASK\nPort the exporter to UTC."),
        "{summary}"
    );
}
