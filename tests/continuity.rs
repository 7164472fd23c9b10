//! The continuity bench's fake tier as a test, so CI guards its target:
//! with a summarizer that writes nothing useful, at least 95% of the facts
//! planted in the compacted part still reach the upstream, at every rung
//! (truncate, prune, summary — here its facts-only fallback — a tight
//! 2048-token window, and a 1,600-token window with 200 for the answer),
//! and every kind in at least 5/6 of the times it is planted: on the six
//! scripted sessions, and on ten in other agents' vocabularies with
//! failures from the corpus. `cargo bench --bench continuity` prints the full
//! table and runs the real llama-server tier.
//!
//! The same sessions as Responses conversations compare the summarizer
//! settings: `local` with its useless summarizer, `provider` against a
//! fake provider whose compaction keeps nothing, where the proxy's facts
//! (in the newest user message) are all that carries the planted facts,
//! and `auto` against a provider that offers that compaction and one that
//! does not; the test prints retention per setting.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../benches/continuity/sessions.rs"]
mod sessions;

use std::time::Duration;

use compactor::app::AppState;
use compactor::config::{Config, ModelConfig, Summarizer};
use compactor::fake_upstream::provider_compact::Behaviour;
use compactor::fake_upstream::{FakeUpstream, Received};
use serde_json::{json, Value};

/// The whole run (24 compactions of ~70k-token sessions) stays under this.
const WHOLE_RUN: Duration = Duration::from_secs(300);

/// Tokens the agent sessions' system prompt and tool schemas may take, so
/// that a 1,600-token window leaves room for the history.
const MAX_PREAMBLE_TOKENS: u64 = 300;

fn check(table: &sessions::Table) {
    let rungs = sessions::per_rung(table);
    let names: Vec<&str> = rungs.iter().map(|r| r.0.as_str()).collect();
    for want in [
        "truncate",
        "prune",
        "fallback",
        "fallback tight",
        "fallback 1600",
    ] {
        assert!(names.contains(&want), "rung {want} never ran: {names:?}");
    }
    for (rung, kept, planted) in rungs {
        assert_ne!(rung, "none", "a session was not compacted");
        assert!(
            kept * 100 >= planted * 95,
            "{rung}: {kept}/{planted} planted facts kept, under 95%"
        );
    }
    // Every kind, at every rung, in at least 5 of 6 of the times it is planted.
    for ((rung, kind), (kept, planted)) in table {
        assert!(
            kept * 6 >= planted * 5,
            "{rung}, {}: {kept}/{planted}",
            kind.name()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_facts_survive_every_rung_with_a_useless_summarizer() {
    let table = tokio::time::timeout(WHOLE_RUN, sessions::fake_tier(1.0))
        .await
        .expect("continuity run timed out");
    sessions::print_table("kept/planted per kind and rung", &table);
    check(&table);
}

/// Sessions in Claude Code's, opencode's, Codex's, aider's and a one-`bash`
/// agent's vocabularies, failing with outputs of the failure corpus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn facts_survive_in_other_agents_vocabularies() {
    let counter = compactor::tokens::TokenCounter::new_warm();
    for s in sessions::agent_sessions(1.0) {
        let preamble = counter
            .count_item(&compactor::wire::item_hash(&s.messages[0]), &s.messages[0])
            + s.tools
                .iter()
                .map(|t| counter.count_item(&compactor::wire::item_hash(t), t))
                .sum::<u64>();
        assert!(preamble < MAX_PREAMBLE_TOKENS, "{}: {preamble}", s.name);
    }
    let table = tokio::time::timeout(WHOLE_RUN, sessions::agents_fake_tier(1.0))
        .await
        .expect("continuity run timed out");
    sessions::print_table("other agents: kept/planted per kind and rung", &table);
    check(&table);
}

/// The rungs a window of at least 4,000 tokens reaches: there every kind
/// of the trail must survive in 95% of the times it is planted.
const TRAIL_RUNGS: [&str; 3] = ["truncate", "prune", "fallback"];

/// The trail of work in eight agents' vocabularies (see
/// `continuity/trail.rs`): every file changed, every command with its exit
/// status as the agent's output stated it, the user's standing rules, a
/// mid-conversation system message and a reversed decision reach the
/// upstream after every rung down to a 4,000-token window, with a
/// summarizer that writes nothing useful; below it (2,048 and 1,600
/// tokens) the task still does, and the table says what else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trail_survives_every_rung_with_a_useless_summarizer() {
    let table = tokio::time::timeout(WHOLE_RUN, sessions::trail_fake_tier(1.0))
        .await
        .expect("continuity run timed out");
    sessions::print_table("the trail: kept/planted per kind and rung", &table);
    let rungs = sessions::per_rung(&table);
    let names: Vec<&str> = rungs.iter().map(|r| r.0.as_str()).collect();
    for want in TRAIL_RUNGS
        .iter()
        .chain(&["fallback tight", "fallback 1600"])
    {
        assert!(names.contains(want), "rung {want} never ran: {names:?}");
    }
    for ((rung, kind), (kept, planted)) in &table {
        assert_ne!(rung, "none", "a session was not compacted");
        if TRAIL_RUNGS.contains(&rung.as_str()) || *kind == sessions::Kind::Task {
            assert!(
                kept * 100 >= planted * 95,
                "{rung}, {}: {kept}/{planted}",
                kind.name()
            );
        }
    }
    // And at every window down to 4,000 tokens (200 for the answer).
    let sweep = tokio::time::timeout(
        WHOLE_RUN,
        sessions::window_sweep(
            &sessions::trail::trail_sessions(1.0),
            &sessions::TRAIL_WINDOWS,
        ),
    )
    .await
    .expect("sweep timed out");
    sessions::print_table("the trail: kept/planted per kind and window", &sweep);
    for ((window, kind), (kept, planted)) in &sweep {
        assert!(
            kept * 100 >= planted * 95,
            "window {window}, {}: {kept}/{planted}",
            kind.name()
        );
    }
}

/// The cost of reading failures, for the performance notes (`--ignored`):
/// the facts, prune stubs and truncation markers of all sixteen sessions.
#[test]
#[ignore]
fn extraction_cost() {
    let (n, bytes, per) = sessions::extraction_cost(5);
    println!(
        "extraction over {n} sessions ({} KiB of history): {per:?} per pass",
        bytes / 1024
    );
}

/// What the ledger and the pinned rules cost in the summary's byte budget,
/// for the notes (`--ignored`): at full size, and within the byte budgets
/// a 4,000- and a 16,000-token window give the summary.
#[test]
#[ignore]
fn ledger_cost() {
    sessions::print_ledger_cost(&[usize::MAX, 16_000, 4_000]);
}

/// The smallest windows at which each kind survives, for the notes
/// (`--ignored`; "failed" counts a request the proxy could not compact).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn window_sweep() {
    let all: Vec<sessions::Session> = sessions::sessions(1.0)
        .into_iter()
        .chain(sessions::agent_sessions(1.0))
        .collect();
    let table = tokio::time::timeout(
        WHOLE_RUN * 2,
        sessions::window_sweep(&all, &[1_600, 1_400, 1_200, 1_000, 800]),
    )
    .await
    .expect("sweep timed out");
    sessions::print_table(
        "kept/planted per kind and window (200 tokens for the answer)",
        &table,
    );
}

/// A Chat Completions message as the Responses items it is.
fn as_responses_items(m: &Value) -> Vec<Value> {
    let content = sessions::content_text(&m["content"]);
    match m["role"].as_str().unwrap_or("") {
        "tool" => vec![json!({"type": "function_call_output",
            "call_id": m["tool_call_id"], "output": content})],
        "assistant" => {
            let mut out = Vec::new();
            if !content.is_empty() {
                out.push(json!({"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": content}]}));
            }
            for c in m["tool_calls"].as_array().into_iter().flatten() {
                out.push(json!({"type": "function_call", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"]}));
            }
            out
        }
        role => vec![json!({"type": "message", "role": role,
            "content": [{"type": "input_text", "text": content}]})],
    }
}

/// A Chat Completions tool schema as Responses declares it.
fn as_responses_tool(t: &Value) -> Value {
    let f = &t["function"];
    json!({"type": "function", "name": f["name"], "description": f["description"],
           "parameters": f["parameters"]})
}

/// What a Responses run of a session gave: its grade, and whether the
/// compaction's summary was the provider's.
struct ResponsesRun {
    graded: sessions::Graded,
    by_provider: bool,
}

/// [`sessions::run`] over `/v1/responses`, with `summarizer`.
async fn run_responses(
    session: &sessions::Session,
    fake: &FakeUpstream,
    cfg: sessions::RunConfig,
    summarizer: Summarizer,
) -> ResponsesRun {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("compactor.db");
    let mut config = Config::default();
    config.upstream.base_url = fake.url();
    config.upstream.discover_windows = false;
    config.store.path = db.display().to_string();
    config.server.shutdown_grace_secs = 2;
    config.compaction.background = false;
    config.compaction.tool_output_max_bytes = cfg.tool_output_max_bytes;
    config.compaction.summarizer = summarizer;
    config.models.insert(
        0,
        ModelConfig {
            pattern: sessions::MODEL.into(),
            context_window: cfg.window,
            max_output_tokens: Some(cfg.max_output),
            ..Default::default()
        },
    );
    let state = AppState::open(config).expect("open state");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(compactor::server::run(listener, state, async {
        let _ = rx.await;
    }));
    let before = fake.received().len();
    let input: Vec<Value> = session
        .messages
        .iter()
        .flat_map(as_responses_items)
        .collect();
    let mut body = json!({"model": sessions::MODEL, "input": input});
    if !session.tools.is_empty() {
        body["tools"] = session.tools.iter().map(as_responses_tool).collect();
    }
    let resp = tokio::time::timeout(
        sessions::STEP,
        reqwest::Client::new()
            .post(format!("http://{addr}/v1/responses"))
            .header("authorization", "Bearer sk-continuity")
            .json(&body)
            .send(),
    )
    .await
    .expect("request timed out")
    .expect("request");
    assert_eq!(resp.status(), 200, "{}", session.name);
    let compaction = resp
        .headers()
        .get("x-compactor-compacted")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let _ = tokio::time::timeout(sessions::STEP, resp.bytes()).await;
    let _ = tx.send(());
    let _ = tokio::time::timeout(sessions::STEP, server).await;
    let received: Vec<Received> = fake.received()[before..].to_vec();
    let summary_calls = received
        .iter()
        .filter(|r| sessions::is_summary_call(r))
        .count();
    let upstream_text = received
        .iter()
        .rev()
        .find(|r| r.path == "/v1/responses")
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .unwrap_or_default();
    let kept = session
        .facts
        .iter()
        .map(|f| {
            let escaped = serde_json::to_string(&f.needle).unwrap_or_default();
            let inner = &escaped[1..escaped.len() - 1];
            (f.kind, upstream_text.contains(inner))
        })
        .collect();
    let row = compaction.and_then(|id| {
        let conn =
            rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .ok()?;
        conn.query_row(
            "SELECT rung, reason FROM compactions WHERE id = ?1",
            [id],
            |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
        )
        .ok()
    });
    let by_provider = row
        .as_ref()
        .is_some_and(|(_, reason)| reason.ends_with("summary by the provider"));
    ResponsesRun {
        graded: sessions::Graded {
            rung: row.map(|(rung, _)| rung),
            kept,
            summary_calls,
        },
        by_provider,
    }
}

/// The summary rung's windows, for one summarizer setting: its label, and
/// the run.
fn summary_windows() -> [(&'static str, sessions::RunConfig); 3] {
    [
        ("", sessions::at(sessions::SUMMARY_WINDOW, 8192)),
        (" tight", sessions::at(sessions::TIGHT_WINDOW, 8192)),
        (
            " 1600",
            sessions::RunConfig {
                window: sessions::TIGHTEST_WINDOW,
                max_output: sessions::TIGHTEST_OUTPUT,
                tool_output_max_bytes: 8192,
                target_ratio: None,
            },
        ),
    ]
}

/// A `compaction.summarizer` setting of the comparison, and whether the
/// fake upstream offers its compaction endpoint.
struct Setting {
    /// The table's label.
    label: &'static str,
    summarizer: Summarizer,
    /// The upstream's `/responses/compact` answers (keeping nothing);
    /// otherwise it is missing (404).
    offered: bool,
}

impl Setting {
    fn endpoint(&self) -> Behaviour {
        if self.offered {
            Behaviour::KeepNothing
        } else {
            Behaviour::Fail(
                404,
                json!({"error": {"message": "Not Found", "type": "invalid_request_error"}}),
            )
        }
    }
}

/// `local`; `provider` (offered); `auto` where the upstream offers it, and
/// where it does not (then the local summarizer writes the summary, in the
/// same request).
const SETTINGS: [Setting; 4] = [
    Setting {
        label: "local",
        summarizer: Summarizer::Local,
        offered: false,
    },
    Setting {
        label: "provider",
        summarizer: Summarizer::Provider,
        offered: true,
    },
    Setting {
        label: "auto",
        summarizer: Summarizer::Auto,
        offered: true,
    },
    Setting {
        label: "auto 404",
        summarizer: Summarizer::Auto,
        offered: false,
    },
];

/// Retention per summarizer setting, over the three windows: planted facts
/// that reached the upstream.
fn print_retention(table: &sessions::Table) {
    println!("\nretention per summarizer setting (all windows)");
    println!("{:<10}{:>14}{:>9}", "setting", "kept/planted", "kept");
    for setting in &SETTINGS {
        let (kept, planted) = sessions::per_rung(table)
            .into_iter()
            .filter(|(rung, _, _)| {
                summary_windows()
                    .iter()
                    .any(|(suffix, _)| *rung == format!("{}{suffix}", setting.label))
            })
            .fold((0, 0), |(k, n), (_, rk, rn)| (k + rk, n + rn));
        println!(
            "{:<10}{:>14}{:>8.1}%",
            setting.label,
            format!("{kept}/{planted}"),
            100.0 * kept as f64 / planted.max(1) as f64
        );
    }
}

/// The six sessions as Responses conversations at the summary rung's
/// windows, for each summarizer setting: `local` (a summarizer that writes
/// nothing useful), `provider` (a provider whose compaction keeps nothing),
/// and `auto` with the provider's compaction offered and missing. Where
/// the provider's compaction is offered every summary is its own (`auto`
/// learning it from the first call), and the planted facts reach the
/// upstream as they do locally, at least 95% of them and every kind 5
/// times in 6 — carried by the proxy's facts in the newest user message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_facts_survive_a_provider_compaction_that_keeps_nothing() {
    let run_all = async {
        let mut table = sessions::Table::new();
        for (i, s) in sessions::sessions(1.0).iter().enumerate() {
            let fake = tokio::time::timeout(sessions::STEP, FakeUpstream::start())
                .await
                .expect("fake upstream timed out")
                .expect("fake upstream");
            fake.set_summary_reply(Some(sessions::useless_summary(i)));
            for (suffix, cfg) in summary_windows() {
                for setting in SETTINGS {
                    fake.set_compact_endpoint(setting.endpoint());
                    let run = run_responses(s, &fake, cfg, setting.summarizer).await;
                    let mut g = run.graded;
                    assert!(
                        g.rung.is_some(),
                        "{} at {}: not compacted",
                        s.name,
                        cfg.window
                    );
                    assert_eq!(
                        run.by_provider, setting.offered,
                        "{} at {}, {}: {:?}",
                        s.name, cfg.window, setting.label, g.rung
                    );
                    if run.by_provider {
                        assert_eq!(g.summary_calls, 0, "{}: no local summary", s.name);
                    } else {
                        assert!(g.summary_calls > 0, "{}: the local summary", s.name);
                    }
                    g.rung = Some(format!("{}{suffix}", setting.label));
                    sessions::report_misses(s.name, &g, &s.facts);
                    sessions::add(&mut table, &g);
                }
            }
        }
        table
    };
    let table = tokio::time::timeout(WHOLE_RUN, run_all)
        .await
        .expect("continuity run timed out");
    sessions::print_table(
        "Responses: kept/planted per kind and summarizer (useless summarizer, provider keeping nothing)",
        &table,
    );
    print_retention(&table);
    for (rung, kept, planted) in sessions::per_rung(&table) {
        assert!(
            kept * 100 >= planted * 95,
            "{rung}: {kept}/{planted} planted facts kept, under 95%"
        );
    }
    for ((rung, kind), (kept, planted)) in &table {
        assert!(
            kept * 6 >= planted * 5,
            "{rung}, {}: {kept}/{planted}",
            kind.name()
        );
    }
}
