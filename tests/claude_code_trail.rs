//! The trail of a real Claude Code session (the CLI as `tests/claude_code.rs`
//! runs it, only its `Bash` tool) after its compaction: the files it
//! created, renamed, deleted and wrote from a Python one-liner, and the
//! commands it ran with their exit status in the words Claude Code sent
//! back, are all in the summary the upstream receives — with a summarizer
//! that writes nothing useful, so what survives is what the proxy keeps.
//! `#[ignore]`d (it needs the CLI): `scripts/test` runs it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod claude;
mod support;

use claude::{Claude, MAX_OUTPUT};
use compactor::compaction::items::{is_summary, text_of};
use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::anthropic::{self, Answer};
use compactor::fake_upstream::Reply;
use serde_json::{json, Value};
use support::{compactions, Harness};

/// The window the proxy is configured with (the fake enforces none): the
/// session passes it a few times over.
const WINDOW: u64 = 12_000;

fn tiny_claude(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "claude-tiny*".into(),
        context_window: WINDOW,
        max_output_tokens: Some(MAX_OUTPUT),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// The first line of the `tool_result` Claude Code sent for `id`, in the
/// first request that holds it.
fn result_head(requests: &[Value], id: &str) -> Option<String> {
    requests.iter().find_map(|body| {
        body["messages"]
            .as_array()?
            .iter()
            .flat_map(|m| m["content"].as_array().into_iter().flatten())
            .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == id)
            .map(|b| {
                let text = match &b["content"] {
                    Value::String(s) => s.clone(),
                    other => text_of(&json!({"role": "user", "content": other})),
                };
                text.lines().next().unwrap_or("").trim().to_string()
            })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code CLI: run scripts/test"]
async fn claude_codes_files_and_command_results_survive_its_compaction() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake
        .set_summary_reply(Some("I could not summarize this.".into()));
    let claude = Claude::new();
    let work = claude.work.path();
    std::fs::create_dir_all(work.join("logs")).unwrap();
    std::fs::create_dir_all(work.join("tmp")).unwrap();
    std::fs::write(work.join("tmp/stale.txt"), "stale\n").unwrap();
    // The trail, early: files created, renamed, deleted, written by Python;
    // commands that fail with different codes and one that succeeds.
    let trail: [(&str, &str); 6] = [
        (
            "toolu_t0",
            "mkdir -p notes && cat > notes/plan.md <<'EOF'\n# Plan\n- reconcile\nEOF",
        ),
        ("toolu_t1", "mv notes/plan.md notes/plan_v2.md"),
        ("toolu_t2", "rm tmp/stale.txt"),
        (
            "toolu_t3",
            "/usr/bin/python3 -c \"open('notes/limits.json', 'w').write('{}')\"",
        ),
        ("toolu_t4", "ls missing_dir_7"),
        ("toolu_t5", "sh -c 'exit 5'"),
    ];
    for (id, cmd) in trail {
        h.fake.push(Reply::Messages(
            Answer::tool_use(
                id,
                "Bash",
                json!({"command": cmd, "description": "Work on the trail"}),
            )
            .thinking("The trail next."),
        ));
    }
    // Then enough output to pass the window a few times.
    for step in 0..24 {
        let file = work.join(format!("logs/{step:02}.txt"));
        std::fs::write(&file, format!("entry {step}: reconciled\n").repeat(120)).unwrap();
        h.fake.push(Reply::Messages(
            Answer::tool_use(
                &format!("toolu_{step:02}"),
                "Bash",
                json!({"command": format!("cat logs/{step:02}.txt"), "description": "Read"}),
            )
            .thinking(&format!("Log {step:02} next.")),
        ));
    }
    h.fake
        .push(Reply::Messages(Answer::text("Done.").thinking("Done.")));
    let out = claude
        .print(
            "Task: tidy the notes and reconcile logs/.",
            &[("ANTHROPIC_BASE_URL", &format!("http://{}", h.addr))],
        )
        .await;
    assert_eq!(out.code, Some(0), "{}", out.describe());
    assert!(compactions(&h) >= 1, "the session was compacted");
    let requests: Vec<Value> = h
        .fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages")
        .map(|r| r.json())
        .filter(|v| !anthropic::is_summarizer_request(v))
        .collect();
    let summary = requests
        .iter()
        .rev()
        .find_map(|v| {
            let first = &v["messages"][0];
            is_summary(first).then(|| text_of(first))
        })
        .expect("a request after the compaction starts with the summary");
    for path in [
        "notes/plan.md — renamed to notes/plan_v2.md",
        "notes/plan_v2.md",
        "tmp/stale.txt — deleted",
        "notes/limits.json",
    ] {
        assert!(summary.contains(path), "{path} missing:\n{summary}");
    }
    for (id, cmd) in &trail[4..] {
        let head = result_head(&requests, id).expect("Claude Code sent the result");
        let line = format!("{cmd} → {head}");
        assert!(
            head.contains("xit code"),
            "Claude Code states the code: {head}"
        );
        assert!(summary.contains(&line), "{line} missing:\n{summary}");
    }
    eprintln!("{summary}");
}
