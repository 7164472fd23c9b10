//! The audit of every compaction, through the real proxy on the fake
//! upstream: each compaction's facts checklist (the task, changed files,
//! failures, decisions, constraints, next steps, commands, rules and system
//! messages the proxy extracted from what it replaced) checked against the request it makes; a fact a rung
//! would drop added to the facts message before the request goes out, and
//! counted; at a window too small for every fact, the lowest kinds recorded
//! as forgotten while the request still succeeds. The CLI, the admin API
//! and `/metrics` show it; on `COMPACTOR_TEST_STORE=postgres` the audit
//! round-trips through PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::{Config, ModelConfig};
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-test-audit-0001";
const TASK: &str = "Fix the expired cookie bug in src/auth.py; keep the API unchanged.";
const DECISION: &str = "Decision: max_age 3600 because sessions last an hour";
const CONSTRAINT: &str = "Never change the cookie name.";
const NEXT: &str = "Next step: rerun pytest -k cookie";
const TRACEBACK: &str = "Traceback (most recent call last):\n  File \"app.py\", line 3, in <module>\n    s = req['session']\nKeyError: 'session'";

/// A window of `tokens` (`max_output` for the answer) for `tiny*` models,
/// compacted only when a request does not fit (no background jobs).
fn window(tokens: u64, max_output: u64) -> impl FnOnce(&mut Config) {
    move |c: &mut Config| {
        c.models.push(ModelConfig {
            pattern: "tiny*".into(),
            context_window: tokens,
            max_output_tokens: Some(max_output),
            trigger_ratio: None,
            ..Default::default()
        });
        c.compaction.background = false;
    }
}

/// Text of `n` bytes no rung can shorten but the summary (user messages).
fn filler(i: usize, n: usize) -> String {
    let line = format!("Background note {i}: the session store keeps a row per login. ");
    line.repeat(n / line.len() + 1)[..n].to_string()
}

/// A chat history planting one fact of each kind early, then `fillers`
/// user messages of `bytes` bytes, then the question.
fn planted_history(fillers: usize, bytes: usize) -> Vec<Value> {
    let patch = "*** Begin Patch\n*** Update File: src/auth.py\n@@ def check(cookie):\n-    max_age = 60\n+    max_age = 3600\n*** End Patch";
    let mut h = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": TASK}),
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "p1", "type": "function", "function": {"name": "apply_patch", "arguments": json!({"input": patch}).to_string()}}]}),
        json!({"role": "tool", "tool_call_id": "p1", "content": "Success."}),
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "shell", "arguments": json!({"command": "pytest"}).to_string()}}]}),
        json!({"role": "tool", "tool_call_id": "t1", "content": format!("Exit code: 1\n{TRACEBACK}\n")}),
        json!({"role": "assistant", "content": format!("{DECISION}.")}),
        json!({"role": "user", "content": CONSTRAINT}),
        json!({"role": "assistant", "content": format!("{NEXT}.")}),
    ];
    for i in 0..fillers {
        h.push(json!({"role": "user", "content": filler(i, bytes)}));
        h.push(json!({"role": "assistant", "content": format!("Noted {i}.")}));
    }
    h.push(json!({"role": "user", "content": "What next?"}));
    h
}

/// Sends a chat request for `tiny-a`; its status and conversation.
async fn chat(h: &Harness, messages: &[Value]) -> (u16, String) {
    let url = format!("{}/chat/completions", h.url());
    let (status, headers, body) =
        post(&url, KEY, &json!({"model": "tiny-a", "messages": messages})).await;
    assert!(
        status == 200,
        "{status}: {}",
        String::from_utf8_lossy(&body)
    );
    let conversation = headers
        .get("x-compactor-conversation")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (status, conversation)
}

/// The audit of the conversation's only compaction, read back from the
/// store through the admin API.
async fn audit_of(h: &Harness, conversation: &str) -> Value {
    within(h.state.store.flush()).await.unwrap();
    let d = h
        .get_json(&format!("/admin/api/conversations/{conversation}"))
        .await;
    let list = d["compactions"].as_array().expect("compactions").clone();
    assert_eq!(list.len(), 1, "{d}");
    let a = list[0]["audit"].clone();
    assert!(a.is_object(), "an audit stored with the compaction: {d}");
    a
}

/// (kind, fact, state) of each checklist line.
fn lines(audit: &Value) -> Vec<(String, String, String)> {
    audit["facts"]
        .as_array()
        .expect("facts")
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap_or_default().to_string(),
                f["fact"].as_str().unwrap_or_default().to_string(),
                f["state"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Every string of the last request the upstream received from a client.
fn sent_text(h: &Harness) -> String {
    fn walk(v: &Value, out: &mut String) {
        match v {
            Value::String(s) => {
                out.push_str(s);
                out.push('\n');
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            Value::Object(o) => o.values().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = String::new();
    walk(&last_client_call(h), &mut out);
    out
}

/// The value of the series `name{labels}` in a scrape (0 when absent).
fn series(scrape: &str, name: &str, labels: &str) -> u64 {
    let want = format!("{name}{{{labels}}} ");
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or(0)
}

const FACTS: &str = "compactor_compaction_facts_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_useless_summarizer_at_a_tight_window_keeps_every_fact_in_the_facts_message() {
    let h = Harness::start_with(window(3000, 300)).await;
    h.fake
        .set_summary_reply(Some("I could not summarize this.".into()));
    let history = planted_history(10, 1200);
    let (_, conversation) = chat(&h, &history).await;
    assert_eq!(compactions(&h), 1, "compacted before it went out");
    let audit = audit_of(&h, &conversation).await;
    let checks = lines(&audit);
    let kinds: Vec<&str> = checks.iter().map(|c| c.0.as_str()).collect();
    for kind in [
        "task",
        "file",
        "failure",
        "decision",
        "next_step",
        "command",
        "rule",
    ] {
        assert!(kinds.contains(&kind), "{kind} not checked: {checks:?}");
    }
    let sent = sent_text(&h);
    for (kind, fact, state) in &checks {
        assert_eq!(state, "present", "{kind} {fact:?}: {audit}");
        assert!(sent.contains(fact.as_str()), "{kind} {fact:?} not sent");
    }
    // The items it removed are named as recall and export name them.
    let removed = audit["removed"].as_array().unwrap();
    assert!(audit["removed_count"].as_u64().unwrap() >= 10, "{audit}");
    assert!(
        removed.iter().all(|r| r
            .as_str()
            .is_some_and(|r| r.starts_with("item:") && r.len() == 21)),
        "{audit}"
    );
    let scrape = h.scrape().await;
    for kind in [
        "task",
        "file",
        "failure",
        "decision",
        "next_step",
        "command",
        "rule",
    ] {
        assert_eq!(
            series(&scrape, FACTS, &format!("kind=\"{kind}\",state=\"kept\"")),
            1,
            "{kind}"
        );
    }
    assert_eq!(
        series(&scrape, FACTS, "kind=\"failure\",state=\"forgotten\""),
        0
    );
}

/// POSTs a Messages request as the Anthropic SDKs do; status and
/// conversation.
async fn messages(h: &Harness, body: &Value) -> (u16, String) {
    let resp = within(
        client()
            .post(format!("{}/messages", h.url()))
            .header("x-api-key", KEY)
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(serde_json::to_vec(body).unwrap())
            .send(),
    )
    .await
    .expect("request");
    let status = resp.status().as_u16();
    let conversation = resp
        .headers()
        .get("x-compactor-conversation")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let bytes = within(resp.bytes()).await.expect("body");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    (status, conversation)
}

/// The failure a harness flags (`is_error`) in words no toolchain prints:
/// the proxy takes its last line as the failure, and the prune stub, which
/// reads only the text, would not say it.
const FLAGGED: &str = "quota exhausted for project alpha-billing (12 deploys per hour)";

/// A Claude Code-shaped loop: the task, a deploy that failed as the
/// harness says, then `steps` deploy logs of `bytes` bytes each.
fn deploy_session(steps: usize, bytes: usize) -> Vec<Value> {
    let log = |i: usize| {
        let line = format!("step {i}: uploaded layer, checksum verified, continuing. ");
        line.repeat(bytes / line.len() + 1)[..bytes].to_string()
    };
    let call = |id: &str, command: &str| {
        json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": id, "name": "Bash", "input": {"command": command}}]})
    };
    let mut m = vec![
        json!({"role": "user", "content": "Deploy the billing service to staging and keep the API unchanged."}),
        call("d0", "deploy billing --env staging"),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "d0", "is_error": true,
            "content": format!("deploying billing to staging\nwaiting for the scheduler\n{FLAGGED}")}]}),
    ];
    for i in 1..=steps {
        let id = format!("d{i}");
        m.push(call(
            &id,
            &format!("deploy billing --env staging --step {i}"),
        ));
        m.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": log(i)}]}));
    }
    m.push(json!({"role": "user", "content": "Status?"}));
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fact_the_prune_stub_drops_is_repaired_into_a_facts_message_and_counted() {
    // A target a prune reaches (the default compacts deeper, to a
    // summary): the rung under test is the prune's.
    let h = Harness::start_with(|c| {
        window(3000, 300)(c);
        c.compaction.target_ratio = 0.4;
    })
    .await;
    let body = json!({"model": "tiny-a", "max_tokens": 300, "messages": deploy_session(6, 2000)});
    let (_, conversation) = messages(&h, &body).await;
    assert_eq!(compactions(&h), 1, "compacted before it went out");
    let audit = audit_of(&h, &conversation).await;
    let d = h
        .get_json(&format!("/admin/api/conversations/{conversation}"))
        .await;
    assert_eq!(d["compactions"][0]["rung"], "prune", "{d}");
    let checks = lines(&audit);
    let failure = checks
        .iter()
        .find(|c| c.0 == "failure")
        .unwrap_or_else(|| panic!("the flagged failure is checked: {checks:?}"));
    assert_eq!(failure.1, FLAGGED);
    assert_eq!(failure.2, "repaired", "{audit}");
    let sent = last_client_call(&h);
    let facts_message = sent["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_str())
        .find(|t| t.starts_with("<compactor_facts>"))
        .unwrap_or_else(|| panic!("a facts message in {sent}"));
    assert!(facts_message.contains(FLAGGED), "{facts_message}");
    // Nothing else was forgotten, and the repair is counted.
    assert!(checks.iter().all(|c| c.2 != "forgotten"), "{checks:?}");
    let scrape = h.scrape().await;
    assert_eq!(
        series(&scrape, FACTS, "kind=\"failure\",state=\"repaired\""),
        1
    );
    assert_eq!(series(&scrape, FACTS, "kind=\"task\",state=\"kept\""), 1);
}

/// A history whose facts alone are over a 1,300-token window's room: a
/// dozen long constraints and decisions besides the task, the failure and
/// the next step. The first constraint carries an escape sequence, as a
/// client may send.
fn crowded_history() -> Vec<Value> {
    let mut h = planted_history(0, 0);
    h.pop();
    for i in 0..12 {
        let esc = if i == 0 { "\u{1b}[31m" } else { "" };
        h.push(json!({"role": "user", "content": format!(
            "Never touch the legacy module number {i}{esc}: it is shared with the reporting job, the nightly export and the audit trail, which read its tables directly, and the finance team reconciles them by hand every Monday morning before the ledger closes.")}));
        h.push(json!({"role": "assistant", "content": format!(
            "Decision: keep handler {i} synchronous because the gateway callbacks must be acknowledged in order, retried by the caller on a timeout, and the settlement report depends on the order in which they were acknowledged by us.")}));
    }
    for i in 0..6 {
        h.push(json!({"role": "user", "content": filler(i, 1500)}));
        h.push(json!({"role": "assistant", "content": format!("Noted {i}.")}));
    }
    h.push(json!({"role": "user", "content": "What next?"}));
    h
}

/// A config file for the CLI, reading the harness's store.
fn config_file(h: &Harness) -> std::path::PathBuf {
    let path = h.dir.path().join("proxy.toml");
    let mut store = format!("path = {:?}\n", h.db.display().to_string());
    if !h.state.config.store.url.is_empty() {
        store += &format!("url = {:?}\n", h.state.config.store.url);
    }
    std::fs::write(&path, format!("[store]\n{store}")).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_a_window_too_small_for_every_fact_the_lowest_are_recorded_forgotten_and_shown() {
    let h = Harness::start_with(window(1300, 200)).await;
    h.fake
        .set_summary_reply(Some("I could not summarize this.".into()));
    let (status, conversation) = chat(&h, &crowded_history()).await;
    assert_eq!(status, 200, "the request never fails for facts");
    let audit = audit_of(&h, &conversation).await;
    let checks = lines(&audit);
    let sent = sent_text(&h);
    let forgotten: Vec<&(String, String, String)> =
        checks.iter().filter(|c| c.2 == "forgotten").collect();
    assert!(!forgotten.is_empty(), "{audit}");
    for (kind, fact, state) in &checks {
        match state.as_str() {
            "forgotten" => {
                assert!(
                    ["constraint", "decision"].contains(&kind.as_str()),
                    "only the lowest kinds give way: {kind} {fact:?}"
                );
                assert!(!sent.contains(fact.as_str()), "{fact:?} is sent");
            }
            _ => assert!(sent.contains(fact.as_str()), "{kind} {fact:?} not sent"),
        }
    }
    for kind in ["task", "failure", "next_step", "file"] {
        assert!(
            checks.iter().any(|c| c.0 == kind && c.2 != "forgotten"),
            "{kind} kept: {checks:?}"
        );
    }
    // Constraints give way before decisions.
    if forgotten.iter().any(|c| c.0 == "decision") {
        assert!(checks
            .iter()
            .filter(|c| c.0 == "constraint")
            .all(|c| c.2 == "forgotten"));
    }
    let scrape = h.scrape().await;
    let counted: u64 = ["constraint", "decision"]
        .iter()
        .map(|k| series(&scrape, FACTS, &format!("kind=\"{k}\",state=\"forgotten\"")))
        .sum();
    assert_eq!(counted, forgotten.len() as u64, "{scrape}");

    // The CLI shows the checklist and what was forgotten, escaped.
    let config = config_file(&h);
    let config = config.to_str().unwrap();
    let (code, out, err) = cli(
        &[
            "conversations",
            "show",
            &conversation,
            "--compaction",
            "1",
            "--config",
            config,
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("── compaction 1 cmp_"), "{out}");
    assert!(out.contains("facts checklist ("), "{out}");
    assert!(
        out.contains(&format!("{} forgotten)", forgotten.len())),
        "{out}"
    );
    let after = out.split("what was forgotten:").nth(1).expect(&out);
    for (kind, fact, _) in &forgotten {
        let first = fact.replace('\u{1b}', "\\u{1b}");
        assert!(
            after.contains(&format!("{kind:<10}  {first}")),
            "{fact:?} in {out}"
        );
    }
    assert!(
        !out.contains('\u{1b}'),
        "no raw escape reaches the terminal: {out}"
    );
    assert!(out.contains("\\u{1b}[31m"), "{out}");
    assert!(out.contains("removed: "), "{out}");
    // The timeline counts them.
    let (code, timeline, err) = cli(
        &["conversations", "show", &conversation, "--config", config],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        timeline.contains(&format!(
            "repaired, {} forgotten (the checklist: --compaction N)",
            forgotten.len()
        )),
        "{timeline}"
    );
    // As JSON, the compaction with its audit.
    let (code, json_out, err) = cli(
        &[
            "conversations",
            "show",
            &conversation,
            "--compaction",
            "1",
            "--json",
            "--config",
            config,
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&json_out).unwrap();
    assert_eq!(v["audit"], audit);
    // A compaction it does not have is an error that says how many it has.
    let (code, _, err) = cli(
        &[
            "conversations",
            "show",
            &conversation,
            "--compaction",
            "2",
            "--config",
            config,
        ],
        &[],
    )
    .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("has 1 compaction: --compaction takes 1 to 1"),
        "{err}"
    );
}

/// Observe mode's would-be compaction carries its audit too (what it would
/// have kept), and is not counted with the compactions that apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_compaction_is_audited_and_not_counted() {
    let h = Harness::start_with(|c| {
        window(3000, 300)(c);
        c.compaction.background = true;
        c.compaction.mode = compactor::config::Mode::Observe;
    })
    .await;
    let history = planted_history(10, 1200);
    let (_, conversation) = chat(&h, &history).await;
    wait_compactions(&h, 1).await;
    let audit = audit_of(&h, &conversation).await;
    let checks = lines(&audit);
    assert!(
        checks.iter().any(|c| c.0 == "task" && c.1 == TASK),
        "{checks:?}"
    );
    assert!(checks.iter().all(|c| c.2 != "forgotten"), "{checks:?}");
    let scrape = h.scrape().await;
    assert_eq!(series(&scrape, FACTS, "kind=\"task\",state=\"kept\""), 0);
}
