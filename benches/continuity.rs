//! Continuity: do the facts an agent needs survive a compaction?
//!
//! `cargo bench --bench continuity`. Six scripted coding-agent sessions (see
//! `continuity/sessions.rs`), one per edit form, each planting seven one-off
//! facts under tens of kilobytes of tool output, are sent through the real
//! proxy (in-process, real sockets) as one request over the window, so the
//! proxy compacts them before they go upstream. The grade is model-free: is
//! each fact's exact text in the request the upstream received?
//!
//! Windows are chosen per session to make each rung run: truncate (window =
//! the session's size), prune (same window, rung 1 disabled), summary (4k
//! window) and summary with a tight window (2048 tokens). Two summarizers:
//!
//! - (a) the fake upstream answering summary calls with nothing useful
//!   (prompt echoes in one-line `LABEL: text` style, or prose);
//! - (b) the real llama-server at `COMPACTOR_LLAMA_URL` (its own window is
//!   2048 tokens, so only the tight window is run, on smaller sessions;
//!   `CONT_LLAMA_SESSIONS`, default 1, sets how many sessions go to it).
//!   Skipped with a message when the variable is unset.
//!
//! `CONT_VERBOSE=1` lists each fact missed; `CONT_DUMP=1` prints what went
//! upstream.
//!
//! Targets: ≥ 95% of the planted facts with (a) at every rung, ≥ 90% with (b).
//! Printed as PASS / MISS; nothing is asserted here (the `continuity` test
//! guards (a) in CI).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use compactor::fake_upstream::FakeUpstream;

#[path = "continuity/sessions.rs"]
mod sessions;
use sessions::{add, fake_tier, per_rung, print_table, report_misses, run, Table, TIGHT_WINDOW};

/// Summary calls the router forwarded, and how many the llama-server refused.
#[derive(Default)]
struct Calls {
    sent: AtomicUsize,
    refused: AtomicUsize,
}

/// A front for the proxy: summary calls go to the real llama-server, the
/// rest to the fake (which records what went upstream).
async fn start_router(llama: String, fake: String, calls: Arc<Calls>) -> String {
    sessions::start_router(
        move |summary| if summary { llama.clone() } else { fake.clone() },
        move |r| {
            if !r.summary {
                return;
            }
            calls.sent.fetch_add(1, Ordering::Relaxed);
            if std::env::var_os("CONT_DUMP").is_some() {
                eprintln!(
                    "--- summarizer answered {}:\n{}",
                    r.status,
                    String::from_utf8_lossy(r.answer)
                );
            }
            if r.status != 200 {
                calls.refused.fetch_add(1, Ordering::Relaxed);
            }
        },
    )
    .await
}

/// Filler volume of the sessions sent to the llama-server: one summary call
/// per ~900 tokens of transcript at a few seconds each on a small CPU
/// model, so its sessions are smaller (still tens of KB of tool output).
const LLAMA_SCALE: f64 = 0.5;

async fn llama_tier(llama: String, n: usize) -> Table {
    let mut table = Table::new();
    for s in sessions::sessions(LLAMA_SCALE).iter().take(n) {
        let fake = FakeUpstream::start().await.expect("fake upstream");
        let calls = Arc::new(Calls::default());
        let router = start_router(
            llama.trim_end_matches('/').to_string(),
            fake.url(),
            calls.clone(),
        )
        .await;
        let t = Instant::now();
        let mut g = run(s, router, &fake, sessions::at(TIGHT_WINDOW, 8192)).await;
        g.rung = g.rung.map(|r| format!("{r} tight"));
        println!(
            "  llama: {} → {:?}, {} summary calls ({} refused), {:.1}s",
            s.name,
            g.rung,
            calls.sent.load(Ordering::Relaxed),
            calls.refused.load(Ordering::Relaxed),
            t.elapsed().as_secs_f64()
        );
        report_misses(s.name, &g, &s.facts);
        add(&mut table, &g);
    }
    table
}

fn verdict(title: &str, table: &Table, target: f64) {
    for (rung, k, n) in per_rung(table) {
        let share = k as f64 / n.max(1) as f64;
        let ok = share >= target && rung != "none";
        println!(
            "{} {title}, {rung}: {k}/{n} = {:.1}% (target ≥ {:.0}%)",
            if ok { "PASS" } else { "MISS" },
            100.0 * share,
            100.0 * target
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (n, bytes, per) = sessions::extraction_cost(20);
        println!("facts, prune stubs and truncation markers of {n} sessions ({} KiB): {per:?} per pass", bytes / 1024);
        sessions::print_ledger_cost(&[usize::MAX, 16_000, 4_000]);
        let t = Instant::now();
        let a = fake_tier(1.0).await;
        let agents = sessions::agents_fake_tier(1.0).await;
        let trail = sessions::trail_fake_tier(1.0).await;
        print_table("(a) the trail: files, commands with their exit status, rules, system messages, reversed decisions — kept/planted per kind and rung", &trail);
        let sweep = sessions::window_sweep(&sessions::trail::trail_sessions(1.0), &sessions::TRAIL_WINDOWS).await;
        print_table("(a) the trail at every window down to 4,000 tokens (200 for the answer)", &sweep);
        print_table("(a) other agents' vocabularies, failures from the corpus — kept/planted per kind and rung", &agents);
        print_table("(a) fake upstream, a summarizer that writes nothing useful — kept/planted per kind and rung", &a);
        println!("({:.1}s)", t.elapsed().as_secs_f64());
        match std::env::var("COMPACTOR_LLAMA_URL") {
            Ok(url) if !url.is_empty() => {
                let n = std::env::var("CONT_LLAMA_SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
                let t = Instant::now();
                let b = llama_tier(url, n).await;
                print_table("(b) real llama-server summarizer, tight window — kept/planted per kind", &b);
                println!("({:.1}s)", t.elapsed().as_secs_f64());
                verdict("(a)", &a, 0.95);
                verdict("(a) other agents", &agents, 0.95);
                verdict("(a) the trail", &trail, 0.95);
                verdict("(b)", &b, 0.90);
            }
            _ => {
                println!("\n(b) skipped: set COMPACTOR_LLAMA_URL to run the real llama-server tier");
                verdict("(a)", &a, 0.95);
                verdict("(a) other agents", &agents, 0.95);
                verdict("(a) the trail", &trail, 0.95);
            }
        }
    });
}
