//! The continuity bench's fake tier as a test, so CI guards its target:
//! with a summarizer that writes nothing useful, at least 95% of the facts
//! planted in the compacted part still reach the upstream, at every rung
//! (truncate, prune, summary — here its facts-only fallback — a tight
//! 2048-token window, and a 1,600-token window with 200 for the answer),
//! and every kind in at least 5/6 of the times it is planted: on the six
//! scripted sessions, and on ten in other agents' vocabularies with
//! failures from the corpus. `cargo bench --bench continuity` prints the full
//! table and runs the real llama-server tier.

#[path = "../benches/continuity/sessions.rs"]
mod sessions;

use std::time::Duration;

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
