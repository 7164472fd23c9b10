//! `compactor demo`: watch tokens climb, compaction fire and tokens drop,
//! offline.
//!
//! The demo starts the [fake upstream](crate::fake_upstream) and a real proxy
//! in front of it on `127.0.0.1:0` (temporary store, a model with a small
//! window), then plays a deterministic coding-agent session through the
//! proxy: a system prompt with tools, a task, then tool calls — file reads,
//! greps, patches, test runs with their errors — and a few user follow-ups.
//! The agent side (both the tool calls and their results) is scripted by
//! the demo; the fake upstream answers every request and reports usage as
//! it always does (a token per 4 bytes of the request it received), and
//! answers the proxy's summarizer calls. Everything the proxy does is the
//! real thing: usage-driven trigger, background compaction, rewrite.
//!
//! Between requests the agent "runs its tool": when the last answer crossed
//! the trigger the demo waits for the background compaction, so the output
//! is the same on every run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::sync::oneshot;

mod report;
mod script;
mod table;

use report::FAKE_COMPLETION_TOKENS;
pub use report::{CompactionEvent, DemoReport, RequestFigures};
use script::{tools, Script};
use table::{bar, print_table};
pub use table::{kilo, thousands};

use crate::app::AppState;
use crate::compaction::summary::SUMMARIZER_MARKER;
use crate::config::{Config, ModelConfig};
use crate::fake_upstream::{FakeUpstream, Received};
use crate::server;

/// The model name the demo session uses (matched by its `[[models]]` entry).
pub const MODEL: &str = "demo-agent";
/// The demo client's key (the fake upstream accepts anything).
const KEY: &str = "sk-demo-offline";
/// The session id the demo client sends, like Codex does.
const SESSION: &str = "demo-session";

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Requests the session sends (at least 2).
    pub requests: usize,
    /// Context window of the demo model, tokens (at least 2,000).
    pub window: u64,
    /// Keep the store at this path (for `compactor conversations … --db`);
    /// `None`: a temporary store, removed at the end.
    pub store: Option<PathBuf>,
    /// Pause between requests, for watching (zero: as fast as it goes).
    pub pause: Duration,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            requests: 48,
            window: 8_000,
            store: None,
            pause: Duration::ZERO,
        }
    }
}

/// Runs the demo silently and returns its figures.
pub async fn run(opts: DemoOptions) -> anyhow::Result<DemoReport> {
    run_with_output(opts, &mut std::io::sink()).await
}

/// Runs the demo, printing as it goes to `out` (for `compactor demo`).
pub async fn run_and_print(opts: DemoOptions, out: &mut (dyn Write + Send)) -> anyhow::Result<()> {
    run_with_output(opts, out).await.map(|_| ())
}

/// Runs the demo, printing as it goes, and returns its figures.
pub async fn run_with_output(
    opts: DemoOptions,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<DemoReport> {
    if opts.requests < 2 {
        bail!("the demo needs at least 2 requests");
    }
    if opts.window < 2_000 {
        bail!("the demo needs a window of at least 2,000 tokens");
    }
    let (dir, db, temporary) = match &opts.store {
        Some(p) => {
            if let Some(parent) = p.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
            }
            (None, p.clone(), false)
        }
        None => {
            // Unique per run, even for runs started together in one process.
            static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "compactor-demo-{}-{}-{run}",
                std::process::id(),
                crate::ids::now_ms()
            ));
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let db = dir.join("demo.db");
            (Some(dir), db, true)
        }
    };
    let result = session(&opts, &db, out).await;
    if let Some(dir) = dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let mut report = result?;
    if !temporary {
        report.store = Some(db);
    }
    Ok(report)
}

/// A proxy over the fake upstream, stopped on drop of the sender.
struct Running {
    state: Arc<AppState>,
    fake: FakeUpstream,
    url: String,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    async fn start(window: u64, db: &Path) -> anyhow::Result<Running> {
        let fake = FakeUpstream::start()
            .await
            .context("cannot start the fake upstream")?;
        let mut config = Config::default();
        config.upstream.base_url = fake.url();
        config.store.path = db.display().to_string();
        config.server.shutdown_grace_secs = 2;
        config.models.insert(
            0,
            ModelConfig {
                pattern: MODEL.into(),
                context_window: window,
                max_output_tokens: Some(window / 8),
                trigger_ratio: None,
                ..Default::default()
            },
        );
        config.validate()?;
        let state = tokio::task::spawn_blocking(move || AppState::open(config)).await??;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/v1", listener.local_addr()?);
        let (tx, rx) = oneshot::channel::<()>();
        let st = state.clone();
        let server = tokio::spawn(async move {
            server::run(listener, st, async {
                let _ = rx.await;
            })
            .await
        });
        Ok(Running {
            state,
            fake,
            url,
            shutdown: Some(tx),
            server: Some(server),
        })
    }

    async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(s) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

async fn session(
    opts: &DemoOptions,
    db: &Path,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<DemoReport> {
    let mut proxy = Running::start(opts.window, db).await?;
    let result = drive(opts, &proxy, out).await;
    proxy.stop().await;
    result
}

async fn drive(
    opts: &DemoOptions,
    proxy: &Running,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<DemoReport> {
    let state = &proxy.state;
    let limits = state.config.model_limits(MODEL);
    let trigger = crate::compaction::policy::trigger_tokens(&limits);
    let window = limits.context_window;
    writeln!(
        out,
        "compactor demo: a scripted coding-agent session through the proxy, offline"
    )?;
    writeln!(
        out,
        "model {MODEL}: window {} tokens, compaction triggers at {:.0}% of the {} an answer leaves ({} tokens)",
        thousands(window),
        limits.trigger_ratio * 100.0,
        thousands(crate::compaction::policy::hard_limit(&limits)),
        thousands(trigger)
    )?;
    writeln!(
        out,
        "proxy {} -> built-in fake upstream {} (usage: a token per 4 bytes received)",
        proxy.url,
        proxy.fake.url()
    )?;
    writeln!(out)?;
    out.flush()?;

    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .build()?;
    let url = format!("{}/chat/completions", proxy.url);
    let credential = format!("Bearer {KEY}");
    let tenant = crate::conversation::tenant_of(&state.tenant_salt, Some(credential.as_bytes()));
    let mut script = Script::new(opts.requests);
    let mut history = script.opening();
    let mut report = DemoReport {
        window,
        ..DemoReport::default()
    };
    let mut last_compaction: Option<String> = None;

    for n in 1..=opts.requests {
        let what = if n == 1 {
            "user: the task".to_string()
        } else {
            script.step(n, &mut history)
        };
        let body = json!({"model": MODEL, "messages": history, "tools": tools()});
        let bytes = serde_json::to_vec(&body)?;
        let uncompacted = (bytes.len() as u64 / 4).max(1);
        let seen_before = proxy.fake.count();
        let compactions_before = state.compactions.len();
        let resp = client
            .post(&url)
            .header("authorization", &credential)
            .header("content-type", "application/json")
            .header("session_id", SESSION)
            .body(bytes)
            .send()
            .await
            .with_context(|| format!("request #{n} failed"))?;
        let status = resp.status();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        let compaction = header("x-compactor-compacted");
        let conversation = header("x-compactor-conversation").unwrap_or_default();
        let answer = resp.bytes().await?;
        if !status.is_success() {
            bail!(
                "request #{n} answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        let answer: Value = serde_json::from_slice(&answer)?;
        let usage = &answer["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
        let total = usage["total_tokens"]
            .as_u64()
            .unwrap_or(prompt + FAKE_COMPLETION_TOKENS);
        let received = proxy.fake.received();
        let sent: Vec<Value> = received[seen_before.min(received.len())..]
            .iter()
            .rev()
            .find(|r| !is_summarizer_call(r))
            .and_then(|r| r.json()["messages"].as_array().cloned())
            .unwrap_or_default();
        let sent_items = sent.len();

        if let Some(id) = compaction.as_deref() {
            if last_compaction.as_deref() != Some(id) {
                let ev = lookup_compaction(state, id, n, history.len(), sent_items).await?;
                // Items the client never sent: the summary, stubs, truncated outputs.
                let rewritten = sent.iter().filter(|m| !history.contains(m)).count();
                let detail = match ev.rung.as_str() {
                    "prune" => format!(" ({rewritten} tool outputs stubbed)"),
                    "truncate" => format!(" ({rewritten} tool outputs truncated)"),
                    _ => String::new(),
                };
                writeln!(
                    out,
                    "[compacted: {} items → {}{detail}, {} → {} tokens, {}]  ({}; {})",
                    ev.items_before,
                    ev.items_after,
                    kilo(ev.tokens_before),
                    kilo(ev.tokens_after),
                    ev.rung,
                    crate::metrics::reason_kind(&ev.reason),
                    ev.id
                )?;
                report.compactions.push(ev);
            }
        }
        last_compaction = compaction.clone();

        let pct = 100.0 * total as f64 / window as f64;
        let mut line = format!(
            "[#{n} context ~{} tokens / window {}, {:.0}%] {} {what}",
            thousands(total),
            thousands(window),
            pct,
            bar(total, window),
        );
        if compaction.is_some() {
            if sent_items == history.len() {
                line.push_str(" · compacted");
            } else {
                line.push_str(&format!(
                    " · sent {sent_items} of {} messages",
                    history.len()
                ));
            }
        }
        let crossed = total >= trigger;
        if crossed {
            line.push_str(" · past the trigger: compacting in the background");
        }
        writeln!(out, "{line}")?;
        out.flush()?;
        report.requests.push(RequestFigures {
            n,
            client_items: history.len(),
            sent_items,
            uncompacted_tokens: uncompacted,
            prompt_tokens: prompt,
            total_tokens: total,
            compaction,
        });

        // The model "answered"; the agent runs its tool meanwhile, and the
        // proxy computes its compaction. After the last request too: its
        // summarizer call is part of what the session cost, and the closing
        // table counts it on both sides (the demo's and the store's).
        if crossed {
            settle(state, &tenant, &conversation, compactions_before).await;
        }
        if !opts.pause.is_zero() {
            tokio::time::sleep(opts.pause).await;
        }
    }

    let summaries: Vec<Received> = proxy
        .fake
        .received()
        .into_iter()
        .filter(is_summarizer_call)
        .collect();
    report.summarizer_calls = summaries.len();
    report.summarizer_input_tokens = summaries
        .iter()
        .map(|r| (r.body.len() as u64 / 4).max(1))
        .sum();
    report.summarizer_repeated_tokens = summaries.iter().map(repeated_tokens).sum();
    state.store.flush().await?;
    let reads = state.clone();
    report.savings =
        tokio::task::spawn_blocking(move || reads.reads.savings(&reads.config).map(|r| r.total))
            .await??;
    print_table(&report, out)?;
    Ok(report)
}

/// Waits (bounded) for the background compaction the last answer started.
async fn settle(state: &Arc<AppState>, tenant: &str, conversation: &str, before: usize) {
    let start = Instant::now();
    loop {
        if state.compactions.len() > before {
            return;
        }
        if let Some(mut rx) = state.compactions.job(tenant, conversation) {
            let _ = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|done| *done)).await;
            return;
        }
        // The job is registered right after the answer, on an accounting thread.
        if start.elapsed() > Duration::from_secs(3) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Tokens of a summary call that repeat the conversation's request: all
/// but the instruction it appends, when it is asked of that request.
fn repeated_tokens(r: &Received) -> u64 {
    let v = r.json();
    let last = v["messages"].as_array().and_then(|m| m.last());
    match last {
        Some(m)
            if m["content"]
                .as_str()
                .is_some_and(|s| s.contains(SUMMARIZER_MARKER)) =>
        {
            (r.body.len().saturating_sub(m.to_string().len()) as u64) / 4
        }
        _ => 0,
    }
}

/// The proxy's summary call: the marker in its system message, or in the
/// user message it appends to the conversation's request.
fn is_summarizer_call(r: &Received) -> bool {
    let v = r.json();
    let marked = |m: &serde_json::Value| {
        m["content"]
            .as_str()
            .is_some_and(|s| s.contains(SUMMARIZER_MARKER))
    };
    let messages = v["messages"].as_array().cloned().unwrap_or_default();
    messages.first().is_some_and(marked) || messages.last().is_some_and(marked)
}

/// The compaction `id` as the store recorded it, read through the store's
/// reads once the store holds it.
async fn lookup_compaction(
    state: &Arc<AppState>,
    id: &str,
    n: usize,
    items_before: usize,
    items_after: usize,
) -> anyhow::Result<CompactionEvent> {
    state.store.flush().await?;
    let reads = state.reads.clone();
    let wanted = id.to_string();
    let c = tokio::task::spawn_blocking(move || reads.compaction(&wanted))
        .await?
        .with_context(|| format!("compaction {id} is not in the store"))?;
    Ok(CompactionEvent {
        id: id.to_string(),
        first_request: n,
        rung: c.rung.as_str().to_string(),
        reason: c.reason,
        items_before,
        items_after,
        tokens_before: c.tokens_before,
        tokens_after: c.tokens_after,
    })
}
