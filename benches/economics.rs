//! The bill of a long agent session under prompt caching, with and without
//! compactor (`docs/PERFORMANCE.md`, "Economics").
//!
//! `cargo bench --bench economics`. Nothing is asserted: the targets are
//! printed as PASS / MISS lines. Knobs (environment):
//!
//! - `ECON_SEED` (default fixed): the session generator's seed;
//!   `ECON_SEEDS=N` runs N seeds (`ECON_SEED`, `ECON_SEED + 1`, …) and
//!   prints the mean and spread of every ratio.
//! - `ECON_REQUESTS` (default 250): agent requests per session.
//! - `ECON_SHAPES` (default `claude,codex`): which sessions to run.
//! - `ECON_THINK_MS` (default 50): real pause after each answer in the
//!   proxied runs, so the proxy's background work is done before the next
//!   request, as an agent's tool execution would let it be.
//! - `ECON_PROXY_CONFIG=FILE`: the proxied runs use this `proxy.toml`
//!   instead of the defaults (its upstream and store are the bench's), to
//!   measure a setting against them.
//! - `ECON_GAP_SLEEP_MS` (default 2500): real pause at each idle gap of the
//!   proxied runs. The fake's clock is simulated, the proxy's is not: the
//!   proxy is told a cache lifetime on the bench's scale
//!   (`compaction.cache_ttl_secs` × 1/300: 5 minutes is 1 s), and sleeps
//!   through each idle gap for this long, so it sees the gap as longer
//!   than the cache's lifetime, as the fake does. 0: the proxy sees no gap.
//! - `ECON_TRACE=1`: one line per billed call (request, kind, prompt, read,
//!   written, output, $).
//! - `ECON_LOG=1`: the proxy's log lines on stderr.
//!
//! **The upstream** is the in-process fake (`compactor::fake_upstream`) with
//! its simulated prompt cache (`fake_upstream::cache`): Anthropic's
//! breakpoints, 20-block lookback, 5-minute / 1-hour lifetimes refreshed on
//! read and 1,024-token minimum; OpenAI's automatic prefix cache in steps of
//! 128 tokens with a 5-minute idle lifetime; tokens counted with the
//! proxy's own estimator (tiktoken o200k) over each block's JSON. The fake
//! enforces the window (Anthropic's "prompt is too long" and "input length
//! and `max_tokens` exceed context limit", OpenAI's
//! `context_length_exceeded`). Its clock is simulated: the bench advances it
//! by each turn's time (4–40 s) and by three idle gaps of 10–50 minutes, all
//! longer than the cache's lifetime, without sleeping.
//!
//! **The sessions** (seeded): a coding agent's tool loop — reads of files,
//! greps, test and build logs, diffs, patches, plan updates; outputs of
//! 0.5–25 KB — with a new user message every 30–50 requests, rendered as
//! two clients render it:
//!
//! - *Claude-Code-shaped* on `/v1/messages`: model `claude-sonnet-4-5`
//!   (200k window), `max_tokens` 32,000, ~18k tokens of tools and system,
//!   `cache_control` on the system and on the last message, moved there every
//!   request, its session id in `metadata.user_id`. It compacts itself as Claude Code does: when the last usage
//!   plus what it added since reaches the effective window (window − 20k
//!   reserved for the summary) − 13k, it sends the whole history with its
//!   summary instruction appended as a last user message (`max_tokens`
//!   20,000), then restarts from the summary and the last user message. On
//!   "input length and `max_tokens` exceed context limit" it lowers
//!   `max_tokens` to fit and sends again, as Claude Code does.
//! - *Codex-shaped* on `/v1/chat/completions`: model `gpt-5-codex` (272k
//!   input window), ~9k tokens of instructions and tools. It compacts at 90%
//!   of the window: the history with Codex's summarization prompt appended,
//!   then restarts from its instructions, its recent user messages (up to
//!   20k tokens) and the summary.
//!
//! The model's answers are scripted (the same tool calls in every run; their
//! output tokens are the answer's tokens plus 150 of reasoning). The
//! clients' own summaries are written by the bench as those prompts ask:
//! every user message, the key decisions, the six most recently read files'
//! first lines, the last errors, the current work and next step. Six facts
//! are planted early (the task's ticket, a line of a file read once, an
//! exact error, a decision, a rule, a next step); after each compaction the
//! first request the upstream receives is searched for each one planted
//! before it.
//!
//! **Runs**, each against a fresh fake: (a) direct, the client compacting
//! itself; (b) through compactor (fresh SQLite store, default settings), the
//! client's own compaction off as compactor's docs advise (Claude Code's
//! window set large, Codex's `model_auto_compact_token_limit` above the
//! window); (c) direct on a 1M window, never compacting.
//!
//! **Priced** from the usage the fake reported for every call — the turns,
//! the clients' compaction calls, the proxy's summary calls — at the list
//! prices in [`PRICES`].
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use compactor::app::AppState;
use compactor::config::Config;
use compactor::fake_upstream::anthropic::Answer;
use compactor::fake_upstream::cache::{Billed, Settings};
use compactor::fake_upstream::{FakeUpstream, Received, Reply};
use compactor::server;
use compactor::store::savings::Savings;
use compactor::tokens::TokenCounter;
use serde_json::{json, Value};
use tokio::sync::oneshot;

const DEFAULT_SEED: u64 = 0x00EC_0A0C_7E55_10A5;
/// The session id the Claude-Code-shaped client sends, as Claude Code does
/// (each run has a proxy of its own).
const CLAUDE_SESSION: &str = "5f0c2a4e-econ-4b1d-9c7e-bench0session";
/// Real seconds per simulated second of the proxy's cache lifetime: the
/// default 5 minutes is 1 s to the proxy, and an idle gap (10–50 minutes
/// simulated) is `ECON_GAP_SLEEP_MS` (2.5 s) of real time.
const TIME_SCALE: f64 = 1.0 / 300.0;
/// Where in an idle gap the fake's clock stands while the bench sleeps
/// through it: 80% of the 5-minute lifetime, when the proxy computes an idle
/// conversation's compaction (the summary call reads a warm cache, as it
/// would).
const GAP_SEEN_AT: Duration = Duration::from_secs(240);
const COMPACTED_HEADER: &str = "x-compactor-compacted";
/// Output tokens of reasoning each scripted answer is billed beyond its
/// visible tokens.
const REASONING_TOKENS: u64 = 150;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ====================================================================== prices

/// Dollars per million tokens. The totals and ratios are at the standard
/// rates; Anthropic's long-context rates (a 1M window's prompts over 200k)
/// are shown beside them, not used in the ratios.
struct Prices {
    name: &'static str,
    input: f64,
    output: f64,
    /// Multipliers of `input` for cache writes (5 min, 1 h) and reads.
    write_5m: f64,
    write_1h: f64,
    read: f64,
    /// Prompts over this many tokens pay (input, output) at these prices
    /// (Anthropic's long-context rates on a 1M window).
    long: Option<(u64, f64, f64)>,
}

/// List prices as published by Anthropic and OpenAI (November 2025),
/// entered by hand. OpenAI's GPT-5 bills no cache write: its uncached input
/// is billed at the input price, its cached input at 0.1×.
const PRICES: [Prices; 2] = [
    Prices {
        name: "Claude Sonnet 4.5: $3 in, $15 out; write 1.25x (5 min) / 2x (1 h), read 0.1x (long context, shown apart: over 200k $6 in, $22.50 out)",
        input: 3.0,
        output: 15.0,
        write_5m: 1.25,
        write_1h: 2.0,
        read: 0.1,
        long: Some((200_000, 6.0, 22.5)),
    },
    Prices {
        name: "GPT-5 / GPT-5-Codex: $1.25 in, $10 out; no write premium, read 0.1x",
        input: 1.25,
        output: 10.0,
        write_5m: 1.0,
        write_1h: 1.0,
        read: 0.1,
        long: None,
    },
];

/// What `b` cost; with `long`, prompts over the long-context threshold at
/// its rates.
fn cost(p: &Prices, b: &Billed, long: bool) -> f64 {
    let u = &b.usage;
    let (input, output) = match p.long {
        Some((over, i, o)) if long && u.prompt() > over => (i, o),
        _ => (p.input, p.output),
    };
    (u.input as f64 * input
        + u.write_5m as f64 * input * p.write_5m
        + u.write_1h as f64 * input * p.write_1h
        + u.read as f64 * input * p.read
        + b.output as f64 * output)
        / 1e6
}

// ====================================================================== rng

/// splitmix64: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

// ====================================================================== text generators

const NOUNS: &[&str] = &[
    "retry",
    "backoff",
    "pool",
    "connection",
    "request",
    "response",
    "header",
    "body",
    "timeout",
    "deadline",
    "budget",
    "jitter",
    "attempt",
    "policy",
    "endpoint",
    "resolver",
    "socket",
    "stream",
    "frame",
    "buffer",
    "cache",
    "entry",
    "token",
    "limit",
    "window",
    "queue",
    "worker",
    "handle",
    "config",
    "metric",
    "span",
    "error",
    "status",
    "route",
    "client",
    "session",
];
const VERBS: &[&str] = &[
    "build", "parse", "send", "retry", "acquire", "release", "record", "resolve", "schedule",
    "poll", "flush", "reset", "check", "compute", "apply", "merge", "decode", "encode", "spawn",
    "cancel", "drain", "refresh", "validate", "emit",
];
const TYPES: &[&str] = &[
    "Duration",
    "usize",
    "u64",
    "Request",
    "Response",
    "HeaderMap",
    "Bytes",
    "String",
    "Option<Instant>",
    "Vec<Attempt>",
    "Arc<Pool>",
    "RetryPolicy",
    "&str",
    "StatusCode",
];
const WORDS: &[&str] = &[
    "the",
    "retry",
    "budget",
    "is",
    "spent",
    "before",
    "the",
    "deadline",
    "when",
    "a",
    "request",
    "fails",
    "with",
    "a",
    "transient",
    "error",
    "so",
    "we",
    "back",
    "off",
    "and",
    "try",
    "again",
    "unless",
    "the",
    "connection",
    "was",
    "reset",
    "by",
    "the",
    "peer",
    "which",
    "means",
    "pool",
    "must",
    "drop",
    "it",
    "first",
    "otherwise",
    "jitter",
    "keeps",
    "clients",
    "from",
    "retrying",
    "in",
    "lockstep",
    "after",
    "an",
    "outage",
    "of",
    "upstream",
];

fn sentence(r: &mut Rng, lo: usize, hi: usize) -> String {
    let n = r.range(lo, hi);
    let mut s: Vec<&str> = (0..n).map(|_| *r.pick(WORDS)).collect();
    let first = s[0].to_string();
    let cap = first[..1].to_uppercase() + &first[1..];
    s[0] = &cap;
    s.join(" ")
}

fn camel(s: &str) -> String {
    s.split('_')
        .map(|w| w[..1].to_uppercase() + &w[1..])
        .collect()
}

/// Rust-like source of about `target` bytes, deterministic in (path, revision).
fn source_file(path: &str, revision: u32, target: usize) -> String {
    let mut r = Rng::new(fnv(path) ^ 0x5EED);
    let mut out = format!(
        "//! {path}: {}.\n//! revision {revision}\n\nuse std::sync::Arc;\nuse std::time::{{Duration, Instant}};\n\nuse crate::error::Error;\nuse crate::pool::Pool;\n\n",
        sentence(&mut r, 6, 12)
    );
    let mut block = 0u32;
    while out.len() < target {
        block += 1;
        let (v, n, n2) = (*r.pick(VERBS), *r.pick(NOUNS), *r.pick(NOUNS));
        let (t, t2) = (*r.pick(TYPES), *r.pick(TYPES));
        match r.below(4) {
            0 => {
                out += &format!(
                    "/// {}.\n#[derive(Debug, Clone)]\npub struct {}{} {{\n",
                    sentence(&mut r, 5, 14),
                    camel(n),
                    camel(n2)
                );
                for _ in 0..r.range(2, 6) {
                    out += &format!(
                        "    /// {}.\n    pub {}_{}: {},\n",
                        sentence(&mut r, 3, 9),
                        r.pick(NOUNS),
                        r.pick(NOUNS),
                        r.pick(TYPES)
                    );
                }
                out += "}\n\n";
            }
            1 | 2 => {
                // Revision-dependent lines: a patched file reads differently.
                let bump = if block % 7 == (revision % 7) && revision > 0 {
                    format!("        // changed in revision {revision}: clamp to the budget\n        let {n} = {n}.min(self.{n2}_limit);\n")
                } else {
                    String::new()
                };
                out += &format!(
                    "/// {}.\npub fn {v}_{n}(&mut self, {n2}: {t}) -> Result<{t2}, Error> {{\n    let {n} = self.{n}.{v}(&{n2})?;\n{bump}    if {n}.is_empty() {{\n        return Err(Error::{}(format!(\"{}: {{}}\", {n2})));\n    }}\n    for attempt in 0..self.policy.max_attempts {{\n        tracing::debug!(attempt, ?{n2}, \"{}\");\n        if let Some(d) = self.{n}_deadline.checked_sub(Instant::now()) {{\n            tokio::time::sleep(d.min(Duration::from_millis({}))).await;\n        }}\n    }}\n    Ok({n}.into())\n}}\n\n",
                    sentence(&mut r, 6, 16),
                    camel(n),
                    sentence(&mut r, 3, 7).to_lowercase(),
                    sentence(&mut r, 3, 6).to_lowercase(),
                    r.range(10, 5000),
                );
            }
            _ => {
                out += &format!(
                    "#[cfg(test)]\nmod {n}_{block}_tests {{\n    use super::*;\n\n    #[test]\n    fn {v}_{n}_{}() {{\n        let mut p = RetryPolicy::default();\n        p.max_attempts = {};\n        assert_eq!(p.{v}_{n}({}).unwrap(), {});\n    }}\n}}\n\n",
                    r.pick(WORDS),
                    r.range(1, 9),
                    r.range(0, 100),
                    r.range(0, 100)
                );
            }
        }
    }
    out
}

fn test_name(r: &mut Rng) -> String {
    format!(
        "{}::tests::{}_{}_{}",
        r.pick(&["retry", "pool", "client", "backoff", "resolver", "body"]),
        r.pick(VERBS),
        r.pick(NOUNS),
        r.pick(&[
            "works",
            "caps_at_max",
            "is_cancelled",
            "within_bounds",
            "survives_reset"
        ])
    )
}

/// `cargo test` output of about `target` bytes with `failing` failures.
fn test_log(r: &mut Rng, target: usize, failing: usize) -> String {
    let mut out = String::from(
        "   Compiling netkit v0.3.1 (/home/dev/netkit)\n    Finished `test` profile [unoptimized + debuginfo] target(s) in 6.84s\n     Running unittests src/lib.rs (target/debug/deps/netkit-3f9a1c2b7d4e5f60)\n\n",
    );
    let total = r.range(60, 140);
    out += &format!("running {total} tests\n");
    let mut failed = Vec::new();
    for i in 0..total {
        let name = test_name(r);
        let ok = i >= failing;
        out += &format!("test {name} ... {}\n", if ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        out += "\nfailures:\n\n";
    }
    let mut t = 0u32;
    for name in &failed {
        out += &format!("---- {name} stdout ----\n");
        // Captured debug logs make failing runs long, as they are in practice.
        while out.len()
            < target * (1 + failed.iter().position(|f| f == name).unwrap_or(0))
                / failed.len().max(1)
        {
            t += 1;
            out += &format!(
                "2025-03-14T09:{:02}:{:02}.{:03}Z DEBUG netkit::{}: {} {}={} attempt={} elapsed_ms={}\n",
                (t / 60) % 60,
                t % 60,
                r.below(1000),
                r.pick(NOUNS),
                sentence(r, 3, 8).to_lowercase(),
                r.pick(NOUNS),
                r.range(0, 9999),
                r.range(0, 5),
                r.range(0, 3000)
            );
        }
        out += &format!(
            "thread '{name}' panicked at src/retry.rs:{}:9:\nassertion `left == right` failed: {}\n  left: {}\n right: {}\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\n",
            r.range(40, 400),
            sentence(r, 4, 9).to_lowercase(),
            r.range(0, 9),
            r.range(0, 9)
        );
    }
    if !failed.is_empty() {
        out += "\nfailures:\n";
        for name in &failed {
            out += &format!("    {name}\n");
        }
        out += &format!(
            "\ntest result: FAILED. {} passed; {} failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.{:02}s\n\nerror: test failed, to rerun pass `--lib`\n",
            total - failed.len(),
            failed.len(),
            r.below(100)
        );
    } else {
        while out.len() < target {
            out += &format!("test {} ... ok\n", test_name(r));
        }
        out += &format!(
            "\ntest result: ok. {total} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.{:02}s\n",
            r.below(100)
        );
    }
    out
}

/// `cargo build` output with warnings (and an error when `broken`).
fn build_log(r: &mut Rng, target: usize, broken: bool) -> String {
    let mut out = String::from("   Compiling netkit v0.3.1 (/home/dev/netkit)\n");
    while out.len() < target {
        let n = *r.pick(NOUNS);
        out += &format!(
            "warning: unused variable: `{n}`\n  --> src/{}.rs:{}:{}\n   |\n{:>3} |     let {n} = self.{}.{}();\n   |         ^^^^^ help: if this is intentional, prefix it with an underscore: `_{n}`\n   |\n   = note: `#[warn(unused_variables)]` on by default\n\n",
            r.pick(NOUNS),
            r.range(10, 500),
            r.range(5, 30),
            r.range(10, 500),
            r.pick(NOUNS),
            r.pick(VERBS)
        );
    }
    if broken {
        out += &format!(
            "error[E0308]: mismatched types\n  --> src/retry.rs:{}:24\n   |\n   = note: expected `Duration`, found `u64`\n\nerror: could not compile `netkit` (lib) due to 1 previous error; 12 warnings emitted\n",
            r.range(40, 400)
        );
    } else {
        out += "    Finished `dev` profile [unoptimized + debuginfo] target(s) in 3.97s\n";
    }
    out
}

fn grep_output(r: &mut Rng, pattern: &str, files: &[(String, usize)]) -> String {
    let mut out = String::new();
    for _ in 0..r.range(6, 60) {
        let (path, _) = r.pick(files);
        out += &format!(
            "{path}:{}:    let {pattern} = self.{}.{}(&{})?;\n",
            r.range(1, 900),
            r.pick(NOUNS),
            r.pick(VERBS),
            r.pick(NOUNS)
        );
    }
    out
}

fn patch_for(r: &mut Rng, path: &str) -> String {
    let n = *r.pick(NOUNS);
    format!(
        "*** Begin Patch\n*** Update File: {path}\n@@ pub fn {}_{n}(&mut self\n-    let {n} = self.{n}.{}(&{})?;\n+    let {n} = self.{n}.{}(&{})?;\n+    let {n} = {n}.min(self.policy.max_{n});\n*** End Patch\n",
        r.pick(VERBS),
        r.pick(VERBS),
        r.pick(NOUNS),
        r.pick(VERBS),
        r.pick(NOUNS)
    )
}

fn diff_output(r: &mut Rng, files: &[(String, usize)]) -> String {
    let mut out = String::new();
    for _ in 0..r.range(1, 4) {
        let (path, _) = r.pick(files);
        out += &format!("diff --git a/{path} b/{path}\nindex 3e1f0a2..9b7c4d1 100644\n--- a/{path}\n+++ b/{path}\n");
        for _ in 0..r.range(2, 8) {
            out += &format!("@@ -{0},7 +{0},8 @@\n", r.range(1, 800));
            for _ in 0..r.range(4, 12) {
                let sign = r.pick(&[" ", " ", "-", "+"]);
                out += &format!(
                    "{sign}    let {} = self.{}.{}();\n",
                    r.pick(NOUNS),
                    r.pick(NOUNS),
                    r.pick(VERBS)
                );
            }
        }
    }
    out
}

// ====================================================================== the session

const TASKS: &[&str] = &[
    "The retry logic in netkit is flaky: `retry::tests::jitter_stays_within_bounds` fails about one run in five on CI, and under load we see clients retrying in lockstep after an upstream outage. Find the cause in src/retry.rs and src/backoff.rs, fix it so that jitter is always within [0.5, 1.5] of the computed delay and the total retry budget is respected, and add a regression test. Do not change the public RetryPolicy API.",
    "Thanks. Now the connection pool: when a request is retried after a `connection reset by peer`, the broken connection goes back into the pool and the next request fails too. Make the pool drop connections that failed with an I/O error, and add a test that reproduces the reset with a fake server.",
    "CI still fails on the `pool::tests::acquire_release_survives_reset` test with this output:\n\nthread 'pool::tests::acquire_release_survives_reset' panicked at src/pool.rs:214:9:\nassertion `left == right` failed: idle connections after reset\n  left: 1\n right: 0\n\nPlease look again; I suspect the drop happens after the connection was already returned.",
    "Good. Please also make the per-request deadline include the time spent waiting for a pooled connection, document the change in CHANGELOG.md under 'Unreleased', and run the whole test suite.",
    "Last thing: clippy complains about `needless_range_loop` in src/backoff.rs and two `redundant_clone` in src/client.rs. Fix those without changing behaviour and give me a summary of everything you changed today.",
    "One more: the resolver caches negative answers forever. Give negative entries a TTL of 30 s (configurable via ResolverConfig::negative_ttl) and test it with a paused tokio clock.",
];

/// The planted facts: (kind, the text searched for).
const FACTS: [(&str, &str); 6] = [
    ("task", "NK-4821"),
    ("file contents", "RETRY_SEED: u64 = 0x5A17_C0DE"),
    ("exact error", "jitter 1.73 outside [0.5, 1.5] at attempt 4"),
    ("decision", "DEC-9"),
    ("rule", "RULE-17"),
    ("next step", "NEXT-040"),
];
/// The requests the file, the error and the decision are planted at.
const FILE_AT: usize = 4;
const ERROR_AT: usize = 9;
const DECISION_AT: usize = 14;
/// The file read once, whose contents are a fact.
const PLANTED_FILE: &str = "src/seed.rs";

/// One tool call the agent makes, with what it returns.
#[derive(Clone)]
struct Call {
    id: u32,
    action: Action,
    output: String,
}

#[derive(Clone)]
enum Action {
    Read(String),
    Grep(String),
    Test,
    Build,
    Diff,
    Ls,
    Patch(String, String),
    Plan(Vec<Value>),
}

/// What the model answers to one request, and what follows it.
enum Turn {
    /// Tool calls (and maybe a sentence); the client appends their outputs.
    Tools {
        text: Option<String>,
        calls: Vec<Call>,
    },
    /// The sub-task done; the user writes the next message.
    Done { text: String, next_user: String },
}

struct Session {
    first_user: String,
    turns: Vec<Turn>,
    /// Simulated time before each request: the turn's time, or an idle gap.
    before: Vec<Duration>,
    gaps: usize,
    /// The request from which each fact of [`FACTS`] is in the history.
    facts_at: [usize; 6],
}

fn build_session(requests: usize, seed: u64) -> Session {
    let mut r = Rng::new(seed);
    let mut files: Vec<(String, usize)> = Vec::new();
    let dirs = ["src", "src/pool", "src/client", "tests", "benches"];
    for (i, n) in [
        "retry", "backoff", "pool", "client", "resolver", "body", "error", "config", "metrics",
        "lib", "conn", "frame", "deadline", "tls", "proxy", "cache", "stream", "util",
    ]
    .iter()
    .enumerate()
    {
        let size = match r.below(10) {
            0..=4 => r.range(500, 4_500),
            5..=7 => r.range(4_500, 12_000),
            _ => r.range(12_000, 25_000),
        };
        files.push((format!("{}/{n}.rs", dirs[i % dirs.len()]), size));
    }
    let mut revision: BTreeMap<String, u32> = BTreeMap::new();
    let first_user = format!(
        "Ticket NK-4821. {} Keep a plan with update_plan as you go.",
        TASKS[0]
    );
    let mut facts_at = [0, FILE_AT + 1, ERROR_AT + 1, DECISION_AT + 1, 0, 0];
    let mut turns = Vec::new();
    let mut before = Vec::new();
    let mut task = 0usize;
    let mut done = 0usize;
    let mut next_user = r.range(30, 50);
    let mut failing = 3usize;
    let mut call_no = 0u32;
    for i in 0..requests {
        before.push(Duration::from_secs(r.range(4, 40) as u64));
        if i + 1 == next_user {
            done += 1;
            task = (task + 1) % TASKS.len();
            let mut next = TASKS[task].to_string();
            match done {
                1 => {
                    next += " Rule from now on: never edit files under src/generated/ by hand, regenerate them (RULE-17).";
                    facts_at[4] = i + 1;
                }
                2 => {
                    next += " When this is done, the next step is to bump the crate to 0.4.0 and tag it (NEXT-040).";
                    facts_at[5] = i + 1;
                }
                _ => {}
            }
            turns.push(Turn::Done {
                text: format!(
                    "Done. {} The tests pass now (`cargo test`: all green). Files touched: {}.",
                    sentence(&mut r, 20, 40),
                    files[r.below(files.len())].0
                ),
                next_user: next,
            });
            next_user += r.range(30, 50);
            failing = r.range(1, 4);
            continue;
        }
        let n_calls = match r.below(20) {
            0..=13 => 1,
            14..=18 => 2,
            _ => 3,
        };
        let mut calls = Vec::new();
        for k in 0..n_calls {
            call_no += 1;
            let (action, output) = if i == FILE_AT && k == 0 {
                let mut content = source_file(PLANTED_FILE, 0, 6_000);
                let at = content.len() / 2;
                let at = content[..at].rfind('\n').map_or(0, |p| p + 1);
                content.insert_str(
                    at,
                    "/// The seed of the jitter generator; tests pin it.\npub const RETRY_SEED: u64 = 0x5A17_C0DE;\n",
                );
                (Action::Read(PLANTED_FILE.into()), content)
            } else if i == ERROR_AT && k == 0 {
                let mut log = test_log(&mut r, 6_000, 1);
                log += "thread 'retry::tests::jitter_stays_within_bounds' panicked at src/retry.rs:214:9:\njitter 1.73 outside [0.5, 1.5] at attempt 4\n";
                (Action::Test, log)
            } else {
                match r.below(20) {
                    0..=6 => {
                        let (path, size) = r.pick(&files).clone();
                        let rev = *revision.get(&path).unwrap_or(&0);
                        (Action::Read(path.clone()), source_file(&path, rev, size))
                    }
                    7..=9 => {
                        let p = format!("{}_{}", r.pick(NOUNS), r.pick(NOUNS));
                        let out = grep_output(&mut r, &p, &files);
                        (Action::Grep(p), out)
                    }
                    10..=12 => {
                        let size = if r.chance(0.2) {
                            r.range(12_000, 25_000)
                        } else {
                            r.range(2_000, 9_000)
                        };
                        let f = if r.chance(0.6) { failing } else { 0 };
                        let log = test_log(&mut r, size, f);
                        if failing > 0 && r.chance(0.3) {
                            failing -= 1;
                        }
                        (Action::Test, log)
                    }
                    13..=15 => {
                        let (path, _) = r.pick(&files).clone();
                        let patch = patch_for(&mut r, &path);
                        if r.chance(0.15) {
                            let out = format!("Failed to apply patch: hunk 1 of {path} does not match.\nerror: patch failed: {path}:{}\nExit code: 1", r.range(10, 400));
                            (Action::Patch(path, patch), out)
                        } else {
                            *revision.entry(path.clone()).or_insert(0) += 1;
                            let out = format!("Success. Updated the following files:\nM {path}\n");
                            (Action::Patch(path, patch), out)
                        }
                    }
                    16..=18 => match r.below(3) {
                        0 => {
                            let size = r.range(1_000, 14_000);
                            let broken = r.chance(0.25);
                            (Action::Build, build_log(&mut r, size, broken))
                        }
                        1 => (Action::Diff, diff_output(&mut r, &files)),
                        _ => {
                            let ls: String = files
                                .iter()
                                .map(|(p, s)| format!("{s:>8}  {p}\n"))
                                .collect();
                            (Action::Ls, ls)
                        }
                    },
                    _ => {
                        let steps: Vec<Value> = (0..r.range(3, 6))
                            .map(|k| json!({"content": sentence(&mut r, 4, 9), "status": if k < 2 { "completed" } else if k == 2 { "in_progress" } else { "pending" }}))
                            .collect();
                        (Action::Plan(steps), "Plan updated".to_string())
                    }
                }
            };
            calls.push(Call {
                id: call_no,
                action,
                output,
            });
        }
        let text = if i == DECISION_AT {
            Some("Decision: cap the backoff at 30 s and keep full jitter, seeded from RETRY_SEED in tests (DEC-9).".to_string())
        } else if r.chance(0.4) {
            Some(sentence(&mut r, 8, 30) + ".")
        } else {
            None
        };
        turns.push(Turn::Tools { text, calls });
    }
    // The idle gaps: before the request that follows the 1st, 3rd and 5th
    // new user message (fewer when the session is short).
    let mut seen = 0;
    let mut gaps = 0usize;
    for i in 0..turns.len() {
        if let Turn::Done { .. } = turns[i] {
            seen += 1;
            // The user comes back after a long pause, three times.
            if matches!(seen, 1 | 3 | 5) && i + 1 < before.len() {
                before[i + 1] = Duration::from_secs(60 * r.range(10, 50) as u64);
                gaps += 1;
            }
        }
    }
    Session {
        first_user,
        turns,
        before,
        gaps,
        facts_at,
    }
}

// ====================================================================== the clients

#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Claude,
    Codex,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    ClientCompacts,
    Proxy,
    Never,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::ClientCompacts => "client compacts",
            Mode::Proxy => "through compactor",
            Mode::Never => "1M, never compacts",
        }
    }
}

const CLAUDE_MODEL: &str = "claude-sonnet-4-5";
const CLAUDE_WINDOW: u64 = 200_000;
const CLAUDE_MAX_TOKENS: u64 = 32_000;
/// Claude Code reserves this much for the summary's answer...
const CLAUDE_SUMMARY_MAX_TOKENS: u64 = 20_000;
/// ...and compacts this far below what remains.
const CLAUDE_BUFFER: u64 = 13_000;
const CODEX_MODEL: &str = "gpt-5-codex";
const CODEX_WINDOW: u64 = 272_000;
const BIG_WINDOW: u64 = 1_000_000;
/// Codex keeps this many tokens of recent user messages when it compacts.
const CODEX_USER_KEEP: u64 = 20_000;

const CLAUDE_COMPACT_PROMPT: &str = "Your task is to create a detailed summary of the conversation so far, paying close attention to the user's explicit requests and your previous actions. This summary should be thorough in capturing technical details, code patterns, and architectural decisions that would be essential for continuing development work without losing context.\n\nBefore providing your final summary, wrap your analysis in <analysis> tags. Your summary should include the following sections:\n\n1. Primary Request and Intent\n2. Key Technical Concepts\n3. Files and Code Sections: enumerate specific files and code sections examined, modified, or created, with snippets where applicable\n4. Errors and fixes: list all errors that you ran into, and how you fixed them\n5. Problem Solving\n6. All user messages: list ALL user messages that are not tool results\n7. Pending Tasks\n8. Current Work\n9. Optional Next Step\n\nRespond with text only; do not call any tools.";
const CLAUDE_CONTINUE: &str = "This session is being continued from a previous conversation that ran out of context. The conversation is summarized below:\n";
const CODEX_COMPACT_PROMPT: &str = "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary for another LLM that will resume the task.\n\nInclude:\n- Current progress and key decisions made\n- Important context, constraints, or user preferences\n- What remains to be done (clear next steps)\n- Any critical data, examples, or references needed to continue\n\nBe concise, structured, and focused on helping the next LLM seamlessly continue the work.";
const CODEX_SUMMARY_PREFIX: &str = "Another language model started to solve this problem and produced a summary of its thinking process. You also have access to the state of the tools that were used by that language model. Use this to build on the work that has already been done and avoid duplicating work. Here is the summary produced by the other language model, use the information in this summary to assist with your own analysis:\n";

/// A long, fixed text (the same in every run) of about `bytes` bytes.
fn boilerplate(tag: u64, bytes: usize) -> String {
    let mut r = Rng::new(0xB0B0 ^ tag);
    let mut s = String::new();
    while s.len() < bytes {
        s += &sentence(&mut r, 8, 24);
        s += if r.chance(0.2) { ".\n\n- " } else { ". " };
    }
    s
}

fn claude_tools() -> Value {
    let names = [
        "Task",
        "Bash",
        "Glob",
        "Grep",
        "LS",
        "ExitPlanMode",
        "Read",
        "Edit",
        "MultiEdit",
        "Write",
        "NotebookEdit",
        "WebFetch",
        "TodoWrite",
        "WebSearch",
        "BashOutput",
        "KillShell",
    ];
    Value::Array(
        names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let len = match *n {
                    "Bash" | "Task" | "TodoWrite" => 9_000,
                    _ => 3_000,
                };
                json!({"name": n, "description": boilerplate(i as u64, len),
                       "input_schema": {"type": "object", "properties": {
                           "file_path": {"type": "string", "description": "The absolute path of the file."},
                           "command": {"type": "string", "description": "The command to run."},
                           "pattern": {"type": "string"}, "todos": {"type": "array", "items": {"type": "object"}}},
                       "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}})
            })
            .collect(),
    )
}

fn codex_tools() -> Value {
    let f = |name: &str, tag: u64, params: Value| json!({"type": "function", "function": {"name": name, "description": boilerplate(tag, 2_500), "parameters": params}});
    json!([
        f(
            "shell",
            100,
            json!({"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}}, "required": ["command"]})
        ),
        f(
            "apply_patch",
            101,
            json!({"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]})
        ),
        f(
            "update_plan",
            102,
            json!({"type": "object", "properties": {"explanation": {"type": "string"}, "plan": {"type": "array", "items": {"type": "object"}}}, "required": ["plan"]})
        ),
        f(
            "view_image",
            103,
            json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
        ),
    ])
}

/// What a client sends and keeps: the fixed head (tools, system) and the
/// history, in its own wire format.
struct Client {
    shape: Shape,
    tools: Value,
    system: Value,
    messages: Vec<Value>,
    /// Compacts itself at this many tokens (`None`: never).
    compact_at: Option<u64>,
    /// Tokens the upstream last reported (prompt + output), and the
    /// client's estimate of what it added since.
    last_usage: u64,
    added: u64,
    counter: TokenCounter,
    /// Every message the user typed, oldest first.
    humans: Vec<String>,
}

impl Client {
    fn new(shape: Shape, session: &Session, compacts: bool) -> Client {
        let counter = TokenCounter::default();
        let (tools, system, compact_at) = match shape {
            Shape::Claude => (
                claude_tools(),
                json!([
                    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                    {"type": "text", "text": format!("You are an interactive CLI tool that helps users with software engineering tasks.\n\n{}", boilerplate(7, 12_000)),
                     "cache_control": {"type": "ephemeral"}},
                ]),
                CLAUDE_WINDOW - CLAUDE_SUMMARY_MAX_TOKENS - CLAUDE_BUFFER,
            ),
            Shape::Codex => (
                codex_tools(),
                json!(format!(
                    "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a user's computer.\n\n{}\n\n<environment_context>\n  <cwd>/home/dev/netkit</cwd>\n  <approval_policy>on-request</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n</environment_context>",
                    boilerplate(8, 34_000)
                )),
                CODEX_WINDOW * 9 / 10,
            ),
        };
        let mut me = Client {
            shape,
            tools,
            system,
            messages: Vec::new(),
            compact_at: compacts.then_some(compact_at),
            last_usage: 0,
            added: 0,
            counter,
            humans: Vec::new(),
        };
        if shape == Shape::Codex {
            let system = me.system.clone();
            me.messages
                .push(json!({"role": "system", "content": system}));
        }
        me.human(&session.first_user);
        me
    }

    fn human(&mut self, text: &str) {
        self.humans.push(text.to_string());
        self.push_user(text);
    }

    fn path(&self) -> &'static str {
        match self.shape {
            Shape::Claude => "/v1/messages",
            Shape::Codex => "/v1/chat/completions",
        }
    }

    fn push(&mut self, m: Value) {
        self.added += self.counter.count_text(&m.to_string());
        self.messages.push(m);
    }

    fn push_user(&mut self, text: &str) {
        let m = match self.shape {
            Shape::Claude => json!({"role": "user", "content": [{"type": "text", "text": text}]}),
            Shape::Codex => json!({"role": "user", "content": text}),
        };
        self.push(m);
    }

    /// The request body for the history as it stands (`max_tokens` for
    /// Messages).
    fn body(&mut self, max_tokens: u64) -> Vec<u8> {
        match self.shape {
            Shape::Claude => {
                // The breakpoint on the last message, moved every request.
                let last = self
                    .messages
                    .last_mut()
                    .and_then(|m| m["content"].as_array_mut())
                    .and_then(|b| b.last_mut());
                if let Some(b) = last {
                    b["cache_control"] = json!({"type": "ephemeral"});
                }
                // Claude Code names its session in `metadata.user_id`.
                let user = json!({"device_id": "econ-bench", "session_id": CLAUDE_SESSION});
                let body = serde_json::to_vec(&json!({
                    "model": CLAUDE_MODEL, "max_tokens": max_tokens, "system": self.system,
                    "tools": self.tools, "messages": self.messages,
                    "metadata": {"user_id": user.to_string()},
                }))
                .expect("serialize");
                if let Some(b) = self
                    .messages
                    .last_mut()
                    .and_then(|m| m["content"].as_array_mut())
                    .and_then(|b| b.last_mut())
                    .and_then(Value::as_object_mut)
                {
                    b.remove("cache_control");
                }
                body
            }
            Shape::Codex => serde_json::to_vec(&json!({
                "model": CODEX_MODEL, "messages": self.messages, "tools": self.tools,
                "tool_choice": "auto", "parallel_tool_calls": true,
            }))
            .expect("serialize"),
        }
    }

    fn due(&self) -> bool {
        self.compact_at
            .is_some_and(|at| self.last_usage + self.added >= at)
    }

    /// The tool call as this client's model would make it: (name, input).
    fn call(&self, c: &Call) -> (String, Value) {
        let root = "/home/dev/netkit";
        match (self.shape, &c.action) {
            (Shape::Claude, Action::Read(p)) => {
                ("Read".into(), json!({"file_path": format!("{root}/{p}")}))
            }
            (Shape::Claude, Action::Grep(p)) => (
                "Grep".into(),
                json!({"pattern": p, "path": "src", "output_mode": "content"}),
            ),
            (Shape::Claude, Action::Test) => (
                "Bash".into(),
                json!({"command": "cargo test", "description": "Run the test suite"}),
            ),
            (Shape::Claude, Action::Build) => (
                "Bash".into(),
                json!({"command": "cargo build", "description": "Build"}),
            ),
            (Shape::Claude, Action::Diff) => (
                "Bash".into(),
                json!({"command": "git diff", "description": "Show changes"}),
            ),
            (Shape::Claude, Action::Ls) => ("LS".into(), json!({"path": root})),
            (Shape::Claude, Action::Patch(p, patch)) => (
                "Edit".into(),
                json!({"file_path": format!("{root}/{p}"), "old_string": patch.lines().nth(3).unwrap_or(""), "new_string": patch.lines().nth(4).unwrap_or("")}),
            ),
            (Shape::Claude, Action::Plan(steps)) => ("TodoWrite".into(), json!({"todos": steps})),
            (Shape::Codex, Action::Read(p)) => (
                "shell".into(),
                json!({"command": ["bash", "-lc", format!("sed -n '1,400p' {p}")]}),
            ),
            (Shape::Codex, Action::Grep(p)) => {
                ("shell".into(), json!({"command": ["rg", "-n", p, "src"]}))
            }
            (Shape::Codex, Action::Test) => ("shell".into(), json!({"command": ["cargo", "test"]})),
            (Shape::Codex, Action::Build) => {
                ("shell".into(), json!({"command": ["cargo", "build"]}))
            }
            (Shape::Codex, Action::Diff) => ("shell".into(), json!({"command": ["git", "diff"]})),
            (Shape::Codex, Action::Ls) => (
                "shell".into(),
                json!({"command": ["ls", "-lR", "src", "tests", "benches"]}),
            ),
            (Shape::Codex, Action::Patch(_, patch)) => {
                ("apply_patch".into(), json!({"input": patch}))
            }
            (Shape::Codex, Action::Plan(steps)) => ("update_plan".into(), json!({"plan": steps})),
        }
    }

    fn call_id(&self, c: &Call) -> String {
        match self.shape {
            Shape::Claude => format!("toolu_{:08}", c.id),
            Shape::Codex => format!("call_{:08}", c.id),
        }
    }

    /// The model's answer to the request before `turn`, as the fake is
    /// scripted to give it, and the assistant message the client keeps.
    fn answer(&self, turn: &Turn) -> (Reply, Value) {
        match self.shape {
            Shape::Claude => {
                let mut content = Vec::new();
                let text = match turn {
                    Turn::Tools { text, .. } => text.clone(),
                    Turn::Done { text, .. } => Some(text.clone()),
                };
                if let Some(t) = text {
                    content.push(json!({"type": "text", "text": t}));
                }
                if let Turn::Tools { calls, .. } = turn {
                    for c in calls {
                        let (name, input) = self.call(c);
                        content.push(json!({"type": "tool_use", "id": self.call_id(c), "name": name, "input": input}));
                    }
                }
                let message = json!({"role": "assistant", "content": content});
                let answer = Answer {
                    content,
                    stop_reason: if matches!(turn, Turn::Tools { .. }) {
                        "tool_use".into()
                    } else {
                        "end_turn".into()
                    },
                    output_tokens: self.counter.count_text(&message.to_string()) + REASONING_TOKENS,
                };
                (Reply::Messages(answer), message)
            }
            Shape::Codex => {
                let message = match turn {
                    Turn::Tools { text, calls } => {
                        let calls: Vec<Value> = calls
                            .iter()
                            .map(|c| {
                                let (name, input) = self.call(c);
                                json!({"id": self.call_id(c), "type": "function", "function": {"name": name, "arguments": input.to_string()}})
                            })
                            .collect();
                        json!({"role": "assistant", "content": text, "tool_calls": calls})
                    }
                    Turn::Done { text, .. } => json!({"role": "assistant", "content": text}),
                };
                let out = self.counter.count_text(&message.to_string()) + REASONING_TOKENS;
                let reply = match turn {
                    Turn::Tools { calls, .. } => {
                        let owned: Vec<(String, String, String)> = calls
                            .iter()
                            .map(|c| {
                                let (name, input) = self.call(c);
                                (self.call_id(c), name, input.to_string())
                            })
                            .collect();
                        let refs: Vec<(&str, &str, &str)> = owned
                            .iter()
                            .map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str()))
                            .collect();
                        Reply::chat_tool_calls(&refs, 0, out)
                    }
                    Turn::Done { text, .. } => Reply::chat(text, 0, out),
                };
                (reply, message)
            }
        }
    }

    /// Appends the model's answer and what follows it (tool outputs, or
    /// the user's next message).
    fn follow(&mut self, turn: &Turn, assistant: Value) {
        self.push(assistant);
        match turn {
            Turn::Tools { calls, .. } => match self.shape {
                Shape::Claude => {
                    let results: Vec<Value> = calls
                        .iter()
                        .map(|c| json!({"type": "tool_result", "tool_use_id": self.call_id(c), "content": c.output}))
                        .collect();
                    self.push(json!({"role": "user", "content": results}));
                }
                Shape::Codex => {
                    for c in calls {
                        let m = json!({"role": "tool", "tool_call_id": self.call_id(c), "content": c.output});
                        self.push(m);
                    }
                }
            },
            Turn::Done { next_user, .. } => self.human(next_user),
        }
    }

    /// The summary this client's model writes when asked to compact before
    /// request `at`, from what the session held so far.
    fn summary(&self, session: &Session, at: usize) -> String {
        let mut users = vec![session.first_user.clone()];
        let mut decisions = Vec::new();
        let mut texts = Vec::new();
        let mut errors: Vec<String> = Vec::new();
        let mut reads: Vec<(String, String)> = Vec::new();
        for turn in &session.turns[..at] {
            match turn {
                Turn::Done { text, next_user } => {
                    texts.push(text.clone());
                    users.push(next_user.clone());
                }
                Turn::Tools { text, calls } => {
                    if let Some(t) = text {
                        if t.starts_with("Decision:") {
                            decisions.push(t.clone());
                        }
                        texts.push(t.clone());
                    }
                    for c in calls {
                        if let Action::Read(p) = &c.action {
                            reads.retain(|(q, _)| q != p);
                            let head: String =
                                c.output.lines().take(12).collect::<Vec<_>>().join("\n");
                            reads.push((p.clone(), head));
                        }
                        for l in c.output.lines() {
                            let l = l.trim();
                            let error = l.starts_with("error")
                                || l.contains("panicked at")
                                || l.starts_with("Failed to apply")
                                || l.starts_with("jitter ");
                            if error && !errors.iter().any(|e| e == l) {
                                errors.push(l.to_string());
                            }
                        }
                    }
                }
            }
        }
        let last =
            |v: &[String], n: usize| -> Vec<String> { v[v.len().saturating_sub(n)..].to_vec() };
        let bullets = |v: &[String]| {
            v.iter()
                .map(|x| format!("- {x}"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        match self.shape {
            Shape::Claude => {
                let files: String = last(
                    &reads.iter().map(|(p, h)| format!("- {p}:\n```rust\n{h}\n```")).collect::<Vec<_>>(),
                    6,
                )
                .join("\n");
                format!(
                    "<analysis>\n{}\n</analysis>\n\n<summary>\n1. Primary Request and Intent:\n{}\n\n2. Key Technical Concepts:\n- retry budgets, jitter, connection pooling, deadlines\n{}\n\n3. Files and Code Sections:\n{files}\n\n4. Errors and fixes:\n{}\n\n5. Problem Solving:\n{}\n\n6. All user messages:\n{}\n\n7. Pending Tasks:\n- {}\n\n8. Current Work:\n{}\n\n9. Optional Next Step:\n- continue with the current task where it stopped\n</summary>",
                    boilerplate(at as u64, 3_000),
                    users.last().cloned().unwrap_or_default(),
                    bullets(&decisions),
                    bullets(&last(&errors, 6)),
                    bullets(&last(&texts, 4)),
                    bullets(&users),
                    users.last().cloned().unwrap_or_default(),
                    bullets(&last(&texts, 2)),
                )
            }
            Shape::Codex => format!(
                "## Progress\n{}\n\n## Key decisions\n{}\n\n## Errors seen\n{}\n\n## Next steps\n- continue: {}",
                bullets(&last(&texts, 4)),
                bullets(&decisions),
                bullets(&last(&errors, 3)),
                users.last().cloned().unwrap_or_default(),
            ),
        }
    }

    /// Restarts from `summary` as this client does after compacting.
    fn restart(&mut self, summary: &str) {
        let users = self.humans.clone();
        self.messages.clear();
        match self.shape {
            Shape::Claude => {
                let last = users.last().cloned().unwrap_or_default();
                self.messages.push(json!({"role": "user", "content": [
                    {"type": "text", "text": format!("{CLAUDE_CONTINUE}{summary}\n\nPlease continue the conversation from where we left it off without asking the user any further questions. Continue with the last task that you were asked to work on.")},
                    {"type": "text", "text": last},
                ]}));
            }
            Shape::Codex => {
                let system = self.system.clone();
                self.messages
                    .push(json!({"role": "system", "content": system}));
                // The most recent user messages, up to the budget, oldest first.
                let mut kept = Vec::new();
                let mut budget = CODEX_USER_KEEP;
                for u in users.iter().rev() {
                    let t = self.counter.count_text(u);
                    if t > budget {
                        break;
                    }
                    budget -= t;
                    kept.push(u.clone());
                }
                for u in kept.into_iter().rev() {
                    self.messages.push(json!({"role": "user", "content": u}));
                }
                self.messages.push(
                    json!({"role": "user", "content": format!("{CODEX_SUMMARY_PREFIX}{summary}")}),
                );
            }
        }
        self.added = self
            .messages
            .iter()
            .map(|m| self.counter.count_text(&m.to_string()))
            .sum();
        self.last_usage = 0;
    }

    /// The compaction request: the history with the summary instruction
    /// appended.
    fn compaction_body(&mut self) -> Vec<u8> {
        let prompt = match self.shape {
            Shape::Claude => CLAUDE_COMPACT_PROMPT,
            Shape::Codex => CODEX_COMPACT_PROMPT,
        };
        self.push_user(prompt);
        let body = self.body(CLAUDE_SUMMARY_MAX_TOKENS);
        self.messages.pop();
        body
    }
}

/// The tokens an answer's usage reports (prompt and output).
fn usage_total(v: &Value) -> u64 {
    let u = &v["usage"];
    if let Some(t) = u["total_tokens"].as_u64() {
        return t;
    }
    [
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "output_tokens",
    ]
    .iter()
    .filter_map(|k| u[*k].as_u64())
    .sum()
}

// ====================================================================== the proxy

struct Proxy {
    base: String,
    config: Config,
    db: PathBuf,
    _dir: tempfile::TempDir,
    shutdown: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// compactor in front of `fake`, with `config` (its upstream and store
    /// replaced).
    async fn start(fake: &FakeUpstream, config: &Config) -> Proxy {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("compactor.db");
        let mut config = config.clone();
        config.upstream.base_url = fake.url();
        config.store.path = db.display().to_string();
        config.server.shutdown_grace_secs = 2;
        let state = AppState::open(config.clone()).expect("open state");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            server::run(listener, state, async {
                let _ = rx.await;
            })
            .await
        });
        Proxy {
            base: format!("http://{addr}"),
            config,
            db,
            _dir: dir,
            shutdown: Some(tx),
            server,
        }
    }

    /// Stops it once its background work is done; the rungs of the
    /// compactions its store recorded, and its own accounting of the bill.
    async fn stop(mut self) -> (Vec<String>, Option<Savings>) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.server).await;
        let Ok(conn) = rusqlite::Connection::open_with_flags(
            &self.db,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        ) else {
            return (Vec::new(), None);
        };
        let savings = compactor::store::savings::report(&conn, &self.config, None)
            .ok()
            .map(|r| r.total);
        let Ok(mut stmt) =
            conn.prepare("SELECT rung, reason FROM compactions ORDER BY created_ms, rowid")
        else {
            return (Vec::new(), savings);
        };
        // "rung (why)", the reason's first word.
        let rungs = stmt
            .query_map([], |r| {
                let (rung, reason) = (r.get::<_, String>(0)?, r.get::<_, String>(1)?);
                let why: String = reason
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .next()
                    .unwrap_or("")
                    .to_string();
                Ok(format!("{rung} ({why})"))
            })
            .map(|rows| rows.filter_map(Result::ok).collect())
            .unwrap_or_default();
        (rungs, savings)
    }
}

// ====================================================================== one run

/// What a call was, for the bill.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An agent turn; `true` for the first one after a compaction.
    Turn(bool),
    /// A summary call: the client's own compaction or the proxy's.
    Summary,
}

#[derive(Default)]
struct RunStats {
    cost: f64,
    /// The same at long-context rates over their threshold.
    cost_long: f64,
    summary_cost: f64,
    prompt: u64,
    read: u64,
    output: u64,
    calls: usize,
    /// Prompt tokens of every agent turn.
    turns: Vec<u64>,
    /// Prompt and cache-read tokens of the first turn after each compaction.
    restarts: Vec<(u64, u64)>,
    compactions: usize,
    rungs: Vec<String>,
    /// The proxy's own accounting (`store::savings`), for the proxied run.
    accounting: Option<Savings>,
    errors: usize,
    error_kinds: BTreeMap<String, usize>,
    /// (read, prompt) of the turns between compactions, and of summary calls.
    between: (u64, u64),
    summaries: (u64, u64, usize),
    /// The session's request being billed, and the run's label, for
    /// `ECON_TRACE`.
    at: usize,
    label: &'static str,
    /// Facts found / looked for after compactions, by kind.
    facts: BTreeMap<&'static str, (usize, usize)>,
    wall: Duration,
}

impl RunStats {
    fn bill(&mut self, prices: &Prices, kind: Kind, billed: &[Billed]) {
        for b in billed {
            let kind = if b.summarizer { Kind::Summary } else { kind };
            let c = cost(prices, b, false);
            if std::env::var_os("ECON_TRACE").is_some() {
                let u = &b.usage;
                println!(
                    "trace {:>18} #{:<3} {:<9} prompt {:>7} read {:>7} write {:>7} input {:>6} out {:>5} ${:.4}",
                    self.label,
                    self.at,
                    match kind {
                        Kind::Summary => "summary",
                        Kind::Turn(true) => "restart",
                        Kind::Turn(false) => "turn",
                    },
                    u.prompt(),
                    u.read,
                    u.write_5m + u.write_1h,
                    u.input,
                    b.output,
                    c
                );
            }
            self.cost += c;
            self.cost_long += cost(prices, b, true);
            self.calls += 1;
            self.prompt += b.usage.prompt();
            self.read += b.usage.read;
            self.output += b.output;
            match kind {
                Kind::Summary => {
                    self.summary_cost += c;
                    self.summaries.0 += b.usage.read;
                    self.summaries.1 += b.usage.prompt();
                    self.summaries.2 += 1;
                }
                Kind::Turn(first) => {
                    self.turns.push(b.usage.prompt());
                    if first {
                        self.restarts.push((b.usage.prompt(), b.usage.read));
                    } else {
                        self.between.0 += b.usage.read;
                        self.between.1 += b.usage.prompt();
                    }
                }
            }
        }
    }

    fn facts_kept(&self) -> (usize, usize) {
        self.facts
            .values()
            .fold((0, 0), |(k, n), (a, b)| (k + a, n + b))
    }
}

fn share(a: u64, b: u64) -> f64 {
    a as f64 / b.max(1) as f64
}

/// The last request to the model the upstream received (not a summary
/// call), as text.
fn last_turn_body(received: &[Received]) -> Option<String> {
    received
        .iter()
        .rev()
        .find(|r| {
            (r.path.ends_with("/messages") || r.path.ends_with("/chat/completions"))
                && !String::from_utf8_lossy(&r.body)
                    .contains(compactor::compaction::summary::SUMMARIZER_MARKER)
        })
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
}

struct Sent {
    status: u16,
    body: Value,
    compaction: Option<String>,
}

async fn post(http: &reqwest::Client, url: &str, shape: Shape, body: Vec<u8>) -> Sent {
    let key = "sk-econ-bench-key";
    let mut rb = http
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    rb = match shape {
        Shape::Claude => rb
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01"),
        Shape::Codex => rb.header("authorization", format!("Bearer {key}")),
    };
    let resp = tokio::time::timeout(Duration::from_secs(120), rb.send())
        .await
        .expect("answered in time")
        .expect("request");
    let status = resp.status().as_u16();
    let compaction = resp
        .headers()
        .get(COMPACTED_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let bytes = tokio::time::timeout(Duration::from_secs(120), resp.bytes())
        .await
        .expect("body in time")
        .unwrap_or_default();
    Sent {
        status,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        compaction,
    }
}

/// The error message of a refused request.
fn error_message(v: &Value) -> String {
    v.pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

/// `X + Y > Z` of Anthropic's "exceed context limit" refusal: (X, Z).
fn context_overflow(message: &str) -> Option<(u64, u64)> {
    let rest = message.split("context limit: ").nth(1)?;
    let mut nums = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u64>().ok());
    let input = nums.next()??;
    let _max = nums.next()??;
    let window = nums.next()??;
    Some((input, window))
}

/// How the proxied runs run.
struct Setup {
    config: Config,
    /// Real pause after each answer.
    think: Duration,
    /// Real pause at each idle gap.
    gap_sleep: Duration,
}

async fn run(
    shape: Shape,
    mode: Mode,
    session: &Session,
    http: &reqwest::Client,
    setup: &Setup,
) -> RunStats {
    let started = Instant::now();
    let prices = &PRICES[price_row(shape)];
    let window = match (mode, shape) {
        (Mode::Never, _) => BIG_WINDOW,
        (_, Shape::Claude) => CLAUDE_WINDOW,
        (_, Shape::Codex) => CODEX_WINDOW,
    };
    let fake = FakeUpstream::start().await.expect("fake upstream");
    fake.simulate_cache(Settings {
        window: Some(window),
    });
    let proxy = match mode {
        Mode::Proxy => Some(Proxy::start(&fake, &setup.config).await),
        _ => None,
    };
    let base = proxy
        .as_ref()
        .map(|p| p.base.clone())
        .unwrap_or_else(|| format!("http://{}", fake.addr()));
    let mut client = Client::new(shape, session, mode == Mode::ClientCompacts);
    let url = format!("{base}{}", client.path());
    let mut stats = RunStats {
        label: mode.label(),
        ..RunStats::default()
    };
    let mut seen_compactions: HashSet<String> = HashSet::new();
    for (i, turn) in session.turns.iter().enumerate() {
        let gap = session.before[i] > compactor::fake_upstream::cache::TTL_5M;
        if mode == Mode::Proxy && gap && !setup.gap_sleep.is_zero() {
            // The proxy sees the gap on its own clock, where it computes an
            // idle conversation's compaction 80% into the cache's lifetime:
            // the fake's clock shows that moment while the bench sleeps.
            let early = GAP_SEEN_AT.min(session.before[i]);
            fake.advance_clock(early);
            tokio::time::sleep(setup.gap_sleep).await;
            fake.advance_clock(session.before[i] - early);
        } else {
            fake.advance_clock(session.before[i]);
        }
        stats.at = i;
        let mut first_after = false;
        let mut attempts = 0;
        loop {
            attempts += 1;
            if client.due() {
                // The client's own compaction.
                let summary = client.summary(session, i);
                let out = client.counter.count_text(&summary) + REASONING_TOKENS;
                fake.push(match shape {
                    Shape::Claude => Reply::Messages(Answer {
                        content: vec![json!({"type": "text", "text": summary})],
                        stop_reason: "end_turn".into(),
                        output_tokens: out,
                    }),
                    Shape::Codex => Reply::chat(&summary, 0, out),
                });
                let body = client.compaction_body();
                let mut sent = post(http, &url, shape, body.clone()).await;
                if let Some((input, w)) = context_overflow(&error_message(&sent.body)) {
                    // As Claude Code does: lower `max_tokens` to what fits.
                    let mut body: Value = serde_json::from_slice(&body).expect("json");
                    body["max_tokens"] = json!(w.saturating_sub(input + 1).max(1));
                    sent = post(http, &url, shape, body.to_string().into_bytes()).await;
                }
                fake.clear_script();
                stats.bill(prices, Kind::Summary, &fake.take_bill());
                fake.take_received();
                if sent.status == 200 {
                    client.restart(&summary);
                    stats.compactions += 1;
                    first_after = true;
                } else {
                    stats.errors += 1;
                    *stats
                        .error_kinds
                        .entry(format!("compaction: {}", error_message(&sent.body)))
                        .or_default() += 1;
                    client.compact_at = None;
                }
                fake.advance_clock(Duration::from_secs(30));
            }
            let (reply, assistant) = client.answer(turn);
            fake.push(reply);
            let mut sent = post(http, &url, shape, client.body(CLAUDE_MAX_TOKENS)).await;
            if sent.status != 200 {
                // As Claude Code does: lower `max_tokens` to what fits.
                if let Some((input, w)) = context_overflow(&error_message(&sent.body)) {
                    let mut body: Value =
                        serde_json::from_slice(&client.body(CLAUDE_MAX_TOKENS)).expect("json");
                    body["max_tokens"] = json!(w.saturating_sub(input + 1).max(1));
                    sent = post(http, &url, shape, body.to_string().into_bytes()).await;
                    *stats
                        .error_kinds
                        .entry("max_tokens lowered to fit (retried)".into())
                        .or_default() += 1;
                }
            }
            fake.clear_script();
            let received = fake.take_received();
            if sent.status != 200 {
                stats.errors += 1;
                let message = error_message(&sent.body);
                *stats
                    .error_kinds
                    .entry(message.chars().take(60).collect())
                    .or_default() += 1;
                stats.bill(prices, Kind::Turn(first_after), &fake.take_bill());
                // A client that compacts tries again compacted, once.
                if client.compact_at.is_some() && attempts < 2 {
                    client.last_usage = client.compact_at.unwrap_or(0);
                    continue;
                }
                client.follow(turn, assistant);
                break;
            }
            if let Some(id) = sent.compaction.clone() {
                if seen_compactions.insert(id) {
                    stats.compactions += 1;
                    first_after = true;
                }
            }
            stats.bill(prices, Kind::Turn(first_after), &fake.take_bill());
            if first_after {
                if let Some(body) = last_turn_body(&received) {
                    for (k, (kind, needle)) in FACTS.iter().enumerate() {
                        if session.facts_at[k] < i {
                            let e = stats.facts.entry(kind).or_default();
                            e.1 += 1;
                            e.0 += usize::from(body.contains(needle));
                        }
                    }
                }
            }
            client.last_usage = usage_total(&sent.body);
            client.added = 0;
            client.follow(turn, assistant);
            break;
        }
        if mode == Mode::Proxy && !setup.think.is_zero() {
            tokio::time::sleep(setup.think).await;
        }
    }
    if let Some(p) = proxy {
        (stats.rungs, stats.accounting) = p.stop().await;
        stats.bill(prices, Kind::Summary, &fake.take_bill());
    }
    stats.wall = started.elapsed();
    stats
}

// ====================================================================== report

fn price_row(shape: Shape) -> usize {
    match shape {
        Shape::Claude => 0,
        Shape::Codex => 1,
    }
}

fn fmt_tok(n: u64) -> String {
    if n >= 1_000_000 {
        format!("{:.2}M", n as f64 / 1e6)
    } else if n >= 10_000 {
        format!("{:.0}k", n as f64 / 1e3)
    } else {
        n.to_string()
    }
}

fn print_runs(shape: Shape, session: &Session, runs: &[(Mode, RunStats)]) {
    let name = match shape {
        Shape::Claude => "Claude-Code-shaped, /v1/messages, claude-sonnet-4-5, 200k window",
        Shape::Codex => "Codex-shaped, /v1/chat/completions, gpt-5-codex, 272k window",
    };
    println!();
    println!(
        "{name}: {} requests (the first {} tokens: tools, system, task), {} idle gaps, {} new user messages",
        session.turns.len(),
        fmt_tok(runs[0].1.turns.first().copied().unwrap_or(0)),
        session.gaps,
        session
            .turns
            .iter()
            .filter(|t| matches!(t, Turn::Done { .. }))
            .count()
    );
    print!("{:<44}", "");
    for (m, _) in runs {
        print!("{:>22}", m.label());
    }
    println!();
    let row = |label: &str, f: &dyn Fn(&RunStats) -> String| {
        print!("{label:<44}");
        for (_, s) in runs {
            print!("{:>22}", f(s));
        }
        println!();
    };
    row("total $", &|s| format!("{:.2}", s.cost));
    if PRICES[price_row(shape)].long.is_some() {
        row("  at long-context rates over 200k", &|s| {
            format!("{:.2}", s.cost_long)
        });
    }
    row("  of which summary calls $", &|s| {
        format!("{:.2}", s.summary_cost)
    });
    row("calls billed (turns + summaries)", &|s| {
        format!("{} + {}", s.turns.len(), s.summaries.2)
    });
    row("input tokens / output tokens", &|s| {
        format!("{} / {}", fmt_tok(s.prompt), fmt_tok(s.output))
    });
    row("cache-read share of input", &|s| {
        format!("{:.1}%", 100.0 * share(s.read, s.prompt))
    });
    row("compactions", &|s| s.compactions.to_string());
    row("average prompt / largest", &|s| {
        let avg = s.turns.iter().sum::<u64>() / (s.turns.len().max(1) as u64);
        format!(
            "{} / {}",
            fmt_tok(avg),
            fmt_tok(s.turns.iter().copied().max().unwrap_or(0))
        )
    });
    row("client errors", &|s| s.errors.to_string());
    row("input read from cache between compactions", &|s| {
        format!("{:.1}%", 100.0 * share(s.between.0, s.between.1))
    });
    row("summary calls: history read from cache", &|s| {
        if s.summaries.2 == 0 {
            return "-".into();
        }
        format!("{:.1}%", 100.0 * share(s.summaries.0, s.summaries.1))
    });
    row("facts kept after compactions", &|s| {
        let (k, n) = s.facts_kept();
        if n == 0 {
            "-".into()
        } else {
            format!("{k}/{n}")
        }
    });
    for (kind, _) in FACTS {
        row(&format!("  {kind}"), &|s| {
            s.facts
                .get(kind)
                .map_or("-".into(), |(k, n)| format!("{k}/{n}"))
        });
    }
    row("proxy's accounting: paid / uncompacted $", &|s| {
        let Some(a) = &s.accounting else {
            return "-".into();
        };
        match (a.cost, a.cost_uncompacted) {
            (Some(c), Some(u)) => format!("{c:.2} / {u:.2}"),
            _ => "no price".into(),
        }
    });
    row("  its net saved $", &|s| {
        s.accounting
            .as_ref()
            .and_then(|a| a.money_saved)
            .map_or("-".into(), |m| format!("{m:.2}"))
    });
    row("wall time s", &|s| format!("{:.1}", s.wall.as_secs_f64()));
    for (m, s) in runs {
        if !s.rungs.is_empty() {
            let mut n: BTreeMap<&str, usize> = BTreeMap::new();
            for r in &s.rungs {
                *n.entry(r.as_str()).or_default() += 1;
            }
            let rungs: Vec<String> = n.iter().map(|(r, c)| format!("{c}× {r}")).collect();
            println!(
                "{}: compactions the store recorded (rung, reason): {}",
                m.label(),
                rungs.join(", ")
            );
        }
        if !s.restarts.is_empty() {
            let r: Vec<String> = s
                .restarts
                .iter()
                .map(|(t, r)| format!("{} ({:.0}% read)", fmt_tok(*t), 100.0 * share(*r, *t)))
                .collect();
            println!(
                "{}: first prompt after each compaction: {}",
                m.label(),
                r.join(", ")
            );
        }
        if !s.error_kinds.is_empty() {
            let kinds: Vec<String> = s
                .error_kinds
                .iter()
                .map(|(k, n)| format!("{n}× {k}"))
                .collect();
            println!("{}: {}", m.label(), kinds.join("; "));
        }
    }
}

/// Mean and sample standard deviation.
fn spread(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

fn main() {
    let requests = env_u64("ECON_REQUESTS", 250).max(20) as usize;
    let seed0 = env_u64("ECON_SEED", DEFAULT_SEED);
    let seeds = env_u64("ECON_SEEDS", 1).max(1);
    let config = match std::env::var_os("ECON_PROXY_CONFIG") {
        Some(path) => Config::from_file(std::path::Path::new(&path)).expect("ECON_PROXY_CONFIG"),
        None => Config::default(),
    };
    // The proxy's clock is real, the fake's simulated: the cache lifetime
    // the proxy is told is on the bench's scale (5 minutes: 1 s).
    let mut config = config;
    config.compaction.cache_ttl_secs *= TIME_SCALE;
    let setup = Setup {
        config,
        think: Duration::from_millis(env_u64("ECON_THINK_MS", 50)),
        gap_sleep: Duration::from_millis(env_u64("ECON_GAP_SLEEP_MS", 2_500)),
    };
    let shapes: Vec<Shape> = std::env::var("ECON_SHAPES")
        .unwrap_or_else(|_| "claude,codex".into())
        .split(',')
        .filter_map(|s| match s.trim() {
            "claude" => Some(Shape::Claude),
            "codex" => Some(Shape::Codex),
            _ => None,
        })
        .collect();
    if std::env::var("ECON_LOG").is_ok_and(|v| !v.is_empty() && v != "0") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .with_writer(std::io::stderr)
            .try_init();
    }
    let started = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let http = rt.block_on(async {
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("client")
    });
    println!("compactor economics under prompt caching: {requests} requests per session, {seeds} seed(s) from {seed0:#x}");
    match std::env::var("ECON_PROXY_CONFIG") {
        Ok(path) => println!("proxied runs: the settings of {path}"),
        Err(_) => println!("proxied runs: default settings"),
    }
    for p in &PRICES {
        println!("prices: {}", p.name);
    }
    // Per shape: (proxy / client compacts, proxy / never) per seed, and
    // the figures the targets name.
    let mut ratios: BTreeMap<&str, Vec<[f64; 5]>> = BTreeMap::new();
    for k in 0..seeds {
        let seed = seed0.wrapping_add(k);
        println!();
        println!("===== seed {seed:#x}");
        for &shape in &shapes {
            let session = build_session(
                requests,
                match shape {
                    Shape::Claude => seed,
                    Shape::Codex => seed ^ 0xC0DE_C0DE,
                },
            );
            let mut runs = Vec::new();
            for mode in [Mode::ClientCompacts, Mode::Proxy, Mode::Never] {
                let s = rt.block_on(run(shape, mode, &session, &http, &setup));
                runs.push((mode, s));
            }
            print_runs(shape, &session, &runs);
            let (client, proxy, never) = (&runs[0].1, &runs[1].1, &runs[2].1);
            let r = [
                proxy.cost / client.cost,
                proxy.cost / never.cost,
                share(proxy.between.0, proxy.between.1),
                if proxy.summaries.2 == 0 {
                    f64::NAN
                } else {
                    share(proxy.summaries.0, proxy.summaries.1)
                },
                proxy.errors as f64,
            ];
            println!(
                "proxy / client compacts {:.2}x, proxy / never compacts {:.2}x",
                r[0], r[1]
            );
            let name = match shape {
                Shape::Claude => "Claude-Code-shaped",
                Shape::Codex => "Codex-shaped",
            };
            ratios.entry(name).or_default().push(r);
        }
    }
    println!();
    println!("===== targets (through compactor), over {seeds} seed(s): mean ± sd [min, max]");
    for (name, rs) in &ratios {
        let col =
            |j: usize| -> Vec<f64> { rs.iter().map(|r| r[j]).filter(|x| !x.is_nan()).collect() };
        let show = |xs: &[f64], pct: bool| {
            let (m, sd) = spread(xs);
            let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if pct {
                format!(
                    "{:.1}% ± {:.1} [{:.1}, {:.1}]",
                    100.0 * m,
                    100.0 * sd,
                    100.0 * lo,
                    100.0 * hi
                )
            } else {
                format!("{m:.2}x ± {sd:.2} [{lo:.2}, {hi:.2}]")
            }
        };
        let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
        let c = col(0);
        println!(
            "{} {name}: proxy ÷ client's own compaction ≤ 0.8 — {}",
            verdict(spread(&c).0 <= 0.8),
            show(&c, false)
        );
        let n = col(1);
        println!(
            "{} {name}: proxy ÷ never compacting (1M window) ≤ 0.6 — {}",
            verdict(spread(&n).0 <= 0.6),
            show(&n, false)
        );
        let b = col(2);
        println!(
            "{} {name}: input read from cache between compactions ≥ 90% — {}",
            verdict(spread(&b).0 >= 0.9),
            show(&b, true)
        );
        let s = col(3);
        if s.is_empty() {
            println!("n/a  {name}: a summary call's history read from cache — no summary call through the proxy");
        } else {
            println!(
                "{} {name}: a summary call's history read from cache ≥ 90% — {}",
                verdict(spread(&s).0 >= 0.9),
                show(&s, true)
            );
        }
        let e: f64 = col(4).iter().sum();
        println!("{} {name}: 0 client errors — {e}", verdict(e == 0.0));
    }
    println!("total bench time {:.1} s", started.elapsed().as_secs_f64());
}
