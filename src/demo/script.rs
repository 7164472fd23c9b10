//! The demo's scripted coding-agent session: the system prompt, the task,
//! the tools, and each step's tool call and its output (file reads, greps,
//! patches, test runs failing then passing), the same on every run.

use serde_json::{json, Value};

const SYSTEM: &str = "You are a coding agent working in the `kvcache` repository (a small Rust \
key-value cache library). Use the tools to inspect files, run the tests and apply patches. Make \
small, reviewable changes, run the tests after every change, and never weaken a test to make it \
pass. Answer concisely.";

const TASK: &str = "TASK: add per-entry TTL support to the cache in src/cache.rs. Add \
`Cache::insert_with_ttl(key, value, ttl: Duration)`; expired entries must never be returned by \
`get` (expire lazily on read) and `Cache::purge_expired()` removes them all. Time comes from the \
injectable `Clock` in src/clock.rs so tests can advance it. Keep the rest of the public API \
unchanged and make `cargo test` pass.";

const FOLLOW_UPS: &[&str] = &[
    "Also: `purge_expired` must not take longer than O(expired entries) — keep a min-heap of \
     expiry times rather than scanning the whole map. And please don't touch src/metrics.rs, \
     another team owns it.",
    "One more constraint from review: `insert` (without TTL) must keep its exact current \
     behaviour, including the eviction order. Add a test for an entry expiring exactly at the \
     TTL boundary (expired at `now == expires_at`).",
    "Looks good so far. Before you finish, run clippy with `-D warnings` and fix what it reports.",
];

const FILES: &[&str] = &[
    "src/cache.rs",
    "src/store.rs",
    "src/clock.rs",
    "src/eviction.rs",
    "src/lib.rs",
    "tests/ttl.rs",
    "src/config.rs",
    "src/stats.rs",
];

pub(super) fn tools() -> Value {
    let tool = |name: &str, desc: &str, params: Value| {
        json!({"type": "function", "function": {"name": name, "description": desc,
               "parameters": {"type": "object", "properties": params,
                              "required": params.as_object().map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default()}}})
    };
    json!([
        tool(
            "read_file",
            "Read a file of the repository.",
            json!({"path": {"type": "string"}})
        ),
        tool(
            "grep",
            "Search the repository with a regular expression.",
            json!({"pattern": {"type": "string"}})
        ),
        tool(
            "apply_patch",
            "Apply a unified diff to one file.",
            json!({"path": {"type": "string"}, "patch": {"type": "string"}})
        ),
        tool(
            "run",
            "Run a shell command in the repository (cargo test, cargo clippy…).",
            json!({"command": {"type": "string"}})
        ),
    ])
}

/// The deterministic session: what each request adds to the history.
pub(super) struct Script {
    requests: usize,
    call: usize,
}

impl Script {
    pub(super) fn new(requests: usize) -> Script {
        Script { requests, call: 0 }
    }

    pub(super) fn opening(&self) -> Vec<Value> {
        vec![
            json!({"role": "system", "content": SYSTEM}),
            json!({"role": "user", "content": TASK}),
        ]
    }

    /// Appends what happened since request `n - 1` and says what it was.
    pub(super) fn step(&mut self, n: usize, history: &mut Vec<Value>) -> String {
        let last = self.requests;
        if n == last {
            history.push(json!({"role": "assistant", "content":
                "All tests pass and clippy is clean. TTL support is in: `insert_with_ttl`, lazy expiry in `get`, \
                 `purge_expired` over a min-heap of expiry times."}));
            history.push(json!({"role": "user", "content":
                "Thanks. Summarize what you changed, file by file, and list anything left open."}));
            return "user: wrap up".into();
        }
        // Follow-ups at fixed fractions of the session.
        for (i, text) in FOLLOW_UPS.iter().enumerate() {
            let at = (last * (i + 1) / (FOLLOW_UPS.len() + 1)).max(2);
            if n == at {
                history.push(json!({"role": "assistant", "content":
                    format!("Progress update: step {n}; continuing with the TTL work.")}));
                history.push(json!({"role": "user", "content": text}));
                return format!("user: follow-up {}", i + 1);
            }
        }
        let k = n - 2;
        let round = k / 7;
        let file = FILES[(k + round) % FILES.len()];
        let (name, args, thought, output, what) = match k % 7 {
            0 | 4 => {
                let f = if k % 7 == 4 {
                    FILES[(k + 3) % FILES.len()]
                } else {
                    file
                };
                (
                    "read_file",
                    json!({"path": f}),
                    format!("Let me read {f} to see how entries are stored and where `get` looks them up before changing anything."),
                    source_file(f, 60 + (k * 7) % 40),
                    format!("read_file {f}"),
                )
            }
            1 => {
                let pat = ["fn get", "expires_at", "Clock::now", "impl Drop", "evict"][round % 5];
                (
                    "grep",
                    json!({"pattern": pat}),
                    format!("I need every use of `{pat}` so the change stays consistent across modules."),
                    grep_output(pat, k),
                    format!("grep {pat:?}"),
                )
            }
            2 | 5 => {
                let patch = patch_for(file, k);
                (
                    "apply_patch",
                    json!({"path": file, "patch": patch}),
                    format!("Applying the change to {file}: thread the expiry time through and keep the old code path for plain inserts."),
                    format!("Applied patch to {file}: 1 file changed, {} insertions(+), {} deletions(-)", 6 + k % 9, 1 + k % 3),
                    format!("apply_patch {file}"),
                )
            }
            _ => {
                let failing = round.is_multiple_of(2);
                (
                    "run",
                    json!({"command": "cargo test"}),
                    "Running the test suite to check the change.".to_string(),
                    test_output(k, failing),
                    format!(
                        "run cargo test ({})",
                        if failing { "fails" } else { "passes" }
                    ),
                )
            }
        };
        let id = format!("call_{:03}", self.call);
        self.call += 1;
        history.push(json!({"role": "assistant", "content": thought, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}
        ]}));
        history.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
        what
    }
}

fn source_file(path: &str, lines: usize) -> String {
    let module = path
        .rsplit('/')
        .next()
        .unwrap_or(path)
        .trim_end_matches(".rs");
    let mut s = format!(
        "// {path}: part of kvcache\nuse std::collections::HashMap;\nuse std::time::Duration;\n\nuse crate::clock::Clock;\n\n"
    );
    let mut i = 0;
    while s.lines().count() < lines {
        s.push_str(&format!(
            "/// {module}: operation {i} on the entry table; keeps the eviction order stable.\n\
             pub fn {module}_op_{i}(table: &mut HashMap<String, Entry>, key: &str, clock: &dyn Clock) -> Option<u64> {{\n    \
             let entry = table.get_mut(key)?;\n    \
             entry.hits += {i};\n    \
             if entry.inserted_at + {} < clock.now() {{\n        return None;\n    }}\n    \
             Some(entry.value.len() as u64 + {i})\n}}\n\n",
            100 + i * 17
        ));
        i += 1;
    }
    s
}

fn grep_output(pat: &str, k: usize) -> String {
    (0..8)
        .map(|i| {
            let f = FILES[(k + i) % FILES.len()];
            format!(
                "{f}:{}:    // {pat} used here by the {} path",
                10 + i * 13 + k,
                ["read", "write", "evict", "purge"][i % 4]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn patch_for(file: &str, k: usize) -> String {
    format!(
        "--- a/{file}\n+++ b/{file}\n@@ -{l},7 +{l},12 @@\n pub struct Entry {{\n     value: Vec<u8>,\n     inserted_at: u64,\n\
         +    /// When the entry stops being visible (None: never).\n+    expires_at: Option<u64>,\n     hits: u32,\n }}\n\
         +\n+fn expired(e: &Entry, now: u64) -> bool {{\n+    e.expires_at.is_some_and(|t| now >= t)\n+}}\n",
        l = 20 + k
    )
}

fn test_output(k: usize, failing: bool) -> String {
    let mut s = String::from("   Compiling kvcache v0.3.1 (/home/dev/kvcache)\n    Finished `test` profile [unoptimized + debuginfo] target(s) in 2.41s\n     Running unittests src/lib.rs (target/debug/deps/kvcache-5f2c)\n\n");
    let tests = 24 + k % 6;
    s.push_str(&format!("running {tests} tests\n"));
    for i in 0..tests {
        let fails = failing && i == tests - 2;
        s.push_str(&format!(
            "test {}::tests::case_{i:02} ... {}\n",
            ["cache", "store", "eviction", "ttl"][i % 4],
            if fails { "FAILED" } else { "ok" }
        ));
    }
    if failing {
        s.push_str(&format!(
            "\nfailures:\n\n---- ttl::tests::case_{:02} stdout ----\n\
             thread 'ttl::tests::case_{:02}' panicked at tests/ttl.rs:{}:5:\nassertion `left == right` failed: expired entry returned by get\n  left: Some(b\"v7\")\n right: None\n\
             note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\n\
             error: test failed, to rerun pass `--lib`\n\ntest result: FAILED. {} passed; 1 failed; 0 ignored\n",
            tests - 2,
            tests - 2,
            30 + k,
            tests - 1
        ));
    } else {
        s.push_str(&format!(
            "\ntest result: ok. {tests} passed; 0 failed; 0 ignored; finished in 0.02s\n"
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_is_deterministic_and_keeps_calls_paired() {
        let run = || {
            let mut s = Script::new(40);
            let mut h = s.opening();
            for n in 2..=40 {
                s.step(n, &mut h);
            }
            h
        };
        let a = run();
        assert_eq!(a, run());
        for (i, m) in a.iter().enumerate() {
            if let Some(calls) = m["tool_calls"].as_array() {
                assert_eq!(a[i + 1]["tool_call_id"], calls[0]["id"]);
            }
        }
        assert_eq!(a.last().unwrap()["role"], "user");
        let users = a.iter().filter(|m| m["role"] == "user").count();
        assert_eq!(users, 2 + FOLLOW_UPS.len());
    }
}
