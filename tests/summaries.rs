//! The summary rung through the real proxy with a summarizer that answers
//! in the one-line `LABEL: text` style and leaves sections out: its
//! sections are kept, the retry names the missing ones, the rest is filled
//! from the recorded facts; and the rules, reminders and ledger the proxy
//! pins survive every later compaction.
#![allow(clippy::unwrap_used, clippy::expect_used)]

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

/// A tool loop past a 3,000-token window, compacted again and again with a
/// summarizer that writes nothing useful: every compacted request that
/// goes upstream still carries the user's standing rule and the
/// harness's reminder verbatim, before the narrative, and the ledger with
/// the newest compacted command in the words its output stated its exit
/// status in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_reminders_and_the_ledger_survive_every_later_compaction() {
    use compactor::compaction::items::{is_summary, text_of};
    let h = Harness::start_with(small_window_foreground).await;
    h.fake
        .set_summary_reply(Some("I could not summarize this.".into()));
    let rule = "From now on, never push to main without a review.";
    let reminder = "<system-reminder>\nThe working directory is now /srv/api. Deferred tools: WebFetch.\n</system-reminder>";
    let mut items = vec![
        json!({"role": "system", "content": "You are a coding agent with one tool: bash."}),
        json!({"role": "user", "content": "Task: make the api tests pass."}),
        json!({"role": "user", "content": [{"type": "text", "text": reminder}, {"type": "text", "text": rule}]}),
    ];
    let mut ran: Vec<String> = Vec::new();
    for step in 0..24 {
        let cmd = format!("make check_{step}");
        let out = format!(
            "<returncode>{}</returncode>\n<output>\n{}</output>",
            step % 3,
            format!("checked part {step}\n").repeat(100)
        );
        bash_step(&h, &mut items, step, &cmd, out).await;
        ran.push(format!("{cmd} → <returncode>{}</returncode>", step % 3));
    }
    let n = support::compactions(&h);
    assert!(n >= 2, "compacted again: {n} compactions");
    let mut compacted = 0;
    for v in support::client_calls(&h) {
        let msgs = v["messages"].as_array().unwrap();
        let Some(s) = msgs.iter().position(is_summary) else {
            continue;
        };
        compacted += 1;
        let summary = text_of(&msgs[s]);
        let at = |x: &str| {
            summary
                .find(x)
                .unwrap_or_else(|| panic!("{x} missing:\n{summary}"))
        };
        assert!(at(rule) < at("## PLAN STATE"), "{summary}");
        assert!(at(reminder) < at("## PLAN STATE"), "{summary}");
        // The newest command the summary covers is in its ledger.
        let newest = ran
            .iter()
            .rev()
            .find(|l| summary.contains(l.split(" → ").next().unwrap()))
            .unwrap_or_else(|| panic!("no command in:\n{summary}"));
        assert!(at(newest) > at("## LEDGER"), "{newest}:\n{summary}");
    }
    assert!(compacted >= 2, "{compacted} compacted requests");
}

/// One step of a bash tool loop through the proxy: the model calls `cmd`
/// (the fake's answer), the call and its `out` join `items`.
async fn bash_step(
    h: &Harness,
    items: &mut Vec<serde_json::Value>,
    step: usize,
    cmd: &str,
    out: String,
) {
    let id = format!("call_{step}");
    let body = json!({"model": "tiny-1", "messages": items});
    let prompt_tokens = serde_json::to_vec(&body).unwrap().len() as u64 / 4;
    h.fake
        .push(compactor::fake_upstream::Reply::chat_tool_calls(
            &[(&id, "bash", &json!({"command": cmd}).to_string())],
            prompt_tokens,
            10,
        ));
    let url = format!("{}/chat/completions", h.url());
    let (status, _, answer) = post(&url, KEY, &body).await;
    assert_eq!(status, 200, "step {step}");
    let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    items.push(answer["choices"][0]["message"].clone());
    items.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
}

/// A later summary compaction keeps the earlier summary's bytes where the
/// upstream last saw them (its prefix stays a cache read) and appends its
/// own after them; once the summaries together would pass their budget
/// (two summaries' worth), the next one rewrites them into one, counted.
/// The standing rule, in the first summary only, reaches every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_summary_is_appended_until_the_summaries_pass_their_budget() {
    use compactor::compaction::items::{is_summary, text_of};
    let h = Harness::start_with(small_window_foreground).await;
    let rule = "From now on, never push to main without a review.";
    let mut items = vec![
        json!({"role": "system", "content": "You are a coding agent with one tool: bash."}),
        json!({"role": "user", "content": "Task: make the api tests pass."}),
        json!({"role": "user", "content": rule}),
    ];
    // The messages of each request that went upstream with summaries.
    let mut seen: Vec<Vec<serde_json::Value>> = Vec::new();
    for step in 0..60 {
        let out = format!("checked part {step}\n").repeat(100);
        bash_step(&h, &mut items, step, &format!("make check_{step}"), out).await;
        let sent = support::last_client_call(&h)["messages"]
            .as_array()
            .unwrap()
            .clone();
        if sent.iter().any(is_summary) {
            seen.push(sent);
        }
        let reasons = support::column::<String>(&*h.sql(), "SELECT reason FROM compactions");
        if reasons
            .iter()
            .any(|r| r.contains("earlier summaries rewritten"))
        {
            break;
        }
    }
    let reasons = support::column::<String>(&*h.sql(), "SELECT reason FROM compactions");
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("appended after the earlier summary")),
        "{reasons:#?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("earlier summaries rewritten")),
        "{reasons:#?}"
    );
    let summaries = |m: &[serde_json::Value]| -> Vec<String> {
        m.iter().filter(|i| is_summary(i)).map(text_of).collect()
    };
    // The first request with two summaries: everything up to and through
    // the first is what the request before it sent, byte for byte.
    let two = seen
        .iter()
        .position(|m| summaries(m).len() == 2)
        .expect("a request with the appended summary");
    assert!(two > 0, "a request with one summary came first");
    let first = seen[two].iter().position(is_summary).unwrap();
    assert_eq!(
        seen[two][..=first],
        seen[two - 1][..=first],
        "the prefix through the earlier summary is kept"
    );
    let second = seen[two].iter().rposition(is_summary).unwrap();
    assert!(second > first + 1, "after what the earlier one kept");
    assert!(
        text_of(&seen[two][second]).contains("(stated in the summary above"),
        "the appended summary points to the task: {}",
        text_of(&seen[two][second])
    );
    // After the rewrite, one summary again.
    assert_eq!(summaries(seen.last().unwrap()).len(), 1);
    for m in &seen {
        assert!(
            m.iter().any(|i| text_of(i).contains(rule)),
            "the rule is sent: {m:#?}"
        );
    }
    let scrape = h.scrape().await;
    for name in [
        "compactor_summaries_appended_total",
        "compactor_summaries_rewritten_total",
    ] {
        let line = scrape
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in\n{scrape}"));
        assert!(!line.ends_with(" 0"), "{line}");
    }
}
