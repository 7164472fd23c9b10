//! The failure corpus (`tests/corpus/failures/`): real outputs of failing
//! tools, each with the text that must be kept. Every entry's kept text
//! must survive the three places a failure is cut down — the prune stub,
//! the truncation marker's digest, and the facts-only summary — in the
//! shapes harnesses hand outputs back in (plain text, Codex's exec header,
//! a JSON wrapper with `exit_code`). The passing outputs must not be
//! reported as failures. Bad input (megabytes, binary junk, ANSI floods,
//! 10,000 error lines) stays within the stated bounds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use compactor::compaction::ladder::{prune_outputs, truncate_outputs, TruncateLimits};
use compactor::compaction::summary::{assemble, extract_facts, Facts};
use compactor::wire::item_hash;
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Debug, Deserialize)]
struct Entry {
    toolchain: String,
    source: String,
    command: String,
    exit_code: i64,
    output: String,
    keep: Vec<String>,
    /// The output itself shows no failure (a test script that prints its
    /// own message and exits 1): only a harness that states the exit code
    /// tells.
    #[serde(default)]
    exit_code_only: bool,
}

fn entries(dir: &str) -> Vec<(String, Entry)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus/failures")
        .join(dir);
    let mut out: Vec<(String, Entry)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|f| f.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read entry");
            let e: Entry =
                serde_json::from_str(&text).unwrap_or_else(|err| panic!("{}: {err}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), e)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The output as harnesses return it: as printed; under Codex's exec
/// header; in a JSON wrapper with its exit code. The last two only when
/// the tool's exit code says it failed (a harness that reports `0` is
/// believed).
fn shapes(e: &Entry) -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    if !e.exit_code_only {
        v.push(("plain", e.output.clone()));
    }
    if e.exit_code != 0 || e.keep.is_empty() {
        v.push((
            "codex exec",
            format!(
                "Chunk ID: 3f2a\nWall time: 1.2 seconds\nProcess exited with code {}\nOriginal token count: 900\nOutput:\n{}",
                e.exit_code, e.output
            ),
        ));
        v.push((
            "json exit_code",
            json!({"output": e.output, "metadata": {"exit_code": e.exit_code, "duration_seconds": 1.2}})
                .to_string(),
        ));
    }
    v
}

/// A call of `command` answered by `output`, after the task.
fn part(command: &str, output: &str) -> Vec<Value> {
    vec![
        json!({"role": "user", "content": "Make the build green."}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
               "function": {"name": "bash", "arguments": json!({"command": command}).to_string()}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": output}),
    ]
}

fn output_text(items: &[Value]) -> String {
    items[2]["content"].as_str().unwrap_or("").to_string()
}

/// Bytes the summary may take in these checks: the default budget is larger.
const SUMMARY_BYTES: usize = 12_000;

#[test]
fn every_failure_keeps_its_text_through_prune_truncation_and_the_summary() {
    let all = entries("failing");
    assert!(all.len() >= 40, "{} failing entries", all.len());
    let documented = all.iter().filter(|(_, e)| e.source == "documented").count();
    assert!(documented < all.len() / 4, "mostly captured: {documented}");
    let toolchains: std::collections::BTreeSet<&str> =
        all.iter().map(|(_, e)| e.toolchain.as_str()).collect();
    assert!(toolchains.len() >= 15, "{toolchains:?}");
    let mut misses = Vec::new();
    for (name, e) in &all {
        assert!(!e.keep.is_empty(), "{name}: nothing to keep");
        for k in &e.keep {
            assert!(
                e.output.contains(k.as_str()),
                "{name}: {k:?} is not in the output"
            );
        }
        for (shape, text) in shapes(e) {
            let items = part(&e.command, &text);
            let hashes: Vec<_> = items.iter().map(item_hash).collect();
            let facts: Facts = extract_facts(&items, None);
            let (pruned, _) = prune_outputs(&items, &hashes);
            let stub = output_text(&pruned);
            let (truncated, _) = truncate_outputs(
                &items,
                &hashes,
                TruncateLimits {
                    max_bytes: 160,
                    keep_head: 60,
                    keep_tail: 40,
                },
            );
            let cut = output_text(&truncated);
            let summary = assemble(&facts, None, items.len(), SUMMARY_BYTES);
            if !facts.tool_log[0].contains("→ error") {
                misses.push(format!("{name} [{shape}]: logged {}", facts.tool_log[0]));
            }
            for k in &e.keep {
                for (place, got) in [
                    ("prune stub", &stub),
                    ("truncation", &cut),
                    ("summary", &summary),
                ] {
                    // An output left as it was is still JSON in the wrapper.
                    let escaped = serde_json::to_string(k).unwrap_or_default();
                    let escaped = &escaped[1..escaped.len() - 1];
                    let json_intact = shape == "json exit_code" && got.contains(escaped);
                    if !got.contains(k.as_str()) && !json_intact {
                        misses.push(format!("{name} [{shape}] {place}: {k:?} lost\n{got}"));
                    }
                }
            }
        }
    }
    assert!(
        misses.is_empty(),
        "{} misses:\n{}",
        misses.len(),
        misses.join("\n---\n")
    );
}

#[test]
fn passing_outputs_are_not_failures() {
    let all = entries("passing");
    assert!(all.len() >= 10, "{} passing entries", all.len());
    let mut wrong = Vec::new();
    for (name, e) in &all {
        assert_eq!(e.exit_code, 0, "{name}");
        for (shape, text) in shapes(e) {
            let items = part(&e.command, &text);
            let facts = extract_facts(&items, None);
            if !facts.errors.is_empty() || !facts.tool_log[0].ends_with("→ ok") {
                wrong.push(format!(
                    "{name} [{shape}]: {:?} / {}",
                    facts.errors, facts.tool_log[0]
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Most bytes a prune stub carries for one output: its header line, three
/// failures of at most 1,000 bytes, the exit code and five paths.
const MAX_STUB_BYTES: usize = 600 + 3 * 1_001 + 1_000;
/// Time allowed for the facts and both cuts of one bad output (a debug
/// build on a shared machine; the scan itself reads at most 1 MiB).
const BAD_INPUT_TIME: Duration = Duration::from_secs(5);

#[test]
fn bad_input_is_bounded_in_time_and_size() {
    let mut junk = Vec::with_capacity(3 << 20);
    let mut x: u32 = 0x9e37_79b9;
    while junk.len() < 3 << 20 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        junk.push((x & 0xff) as u8);
    }
    let cases = [
        (
            "4 MB of log lines",
            "test a::b ... ok\n".repeat(250_000) + "error: the last line\n",
        ),
        (
            "10,000 error lines",
            "error: boom\nFAILED x\nTraceback (most recent call last):\n".repeat(10_000),
        ),
        (
            "ANSI flood",
            "\u{1b}[32m\u{1b}[1m✓\u{1b}[0m test ok \u{1b}[2m(3ms)\u{1b}[0m\n".repeat(60_000)
                + "\u{1b}[31m│ \u{1b}[1mError: at the end\u{1b}[0m\n",
        ),
        (
            "ANSI on one line",
            "\u{1b}[31m\u{1b}[1m│ ".repeat(200_000) + "Error: at the end\n",
        ),
        ("binary junk", String::from_utf8_lossy(&junk).into_owned()),
        ("one 2 MB line", format!("error: {}", "x".repeat(2 << 20))),
        ("a million newlines", "\n".repeat(1 << 20) + "panic: late\n"),
    ];
    for (name, out) in cases {
        let t = Instant::now();
        let items = part("make", &out);
        let hashes: Vec<_> = items.iter().map(item_hash).collect();
        let facts = extract_facts(&items, None);
        let (pruned, _) = prune_outputs(&items, &hashes);
        let (truncated, _) = truncate_outputs(
            &items,
            &hashes,
            TruncateLimits {
                max_bytes: 8192,
                keep_head: 4096,
                keep_tail: 2048,
            },
        );
        let took = t.elapsed();
        assert!(took < BAD_INPUT_TIME, "{name}: {took:?}");
        let stub = output_text(&pruned);
        assert!(
            stub.len() <= MAX_STUB_BYTES,
            "{name}: stub of {} bytes",
            stub.len()
        );
        let cut = output_text(&truncated);
        assert!(
            cut.len() <= 8192 + MAX_STUB_BYTES,
            "{name}: truncated to {} bytes",
            cut.len()
        );
        if name != "binary junk" && name != "ANSI on one line" {
            assert_eq!(
                facts.errors.len().min(1),
                1,
                "{name}: the failure at the end is found"
            );
        }
        assert!(
            facts.errors.len() <= 3,
            "{name}: {} failures",
            facts.errors.len()
        );
        // The ledger holds the one command, its status line clipped.
        assert_eq!(facts.commands.len(), 1, "{name}");
        assert!(facts.commands[0].line().len() <= 400, "{name}");
        assert!(
            facts
                .errors
                .iter()
                .all(|e| e.len() <= 1_000 && e.lines().count() <= 8),
            "{name}: {:?}",
            facts.errors.iter().map(String::len).collect::<Vec<_>>()
        );
        eprintln!(
            "{name}: {took:?}, stub {} bytes, {} failures",
            stub.len(),
            facts.errors.len()
        );
    }
}

/// A history of `n` shell calls in the exit-status vocabularies the ledger
/// reads, each deleting, moving and writing files, with a user rule and a
/// reminder every tenth call.
fn trail_history(n: usize) -> Vec<Value> {
    let mut items = vec![json!({"role": "user", "content": "Clean up the workspace."})];
    let outputs = [
        "Exit code 2\nls: cannot access 'x': No such file or directory",
        "Chunk ID: 1\nWall time: 0.1 seconds\nProcess exited with code 5\nOutput:\n",
        "<returncode>1</returncode>\n<output>\nboom\n</output>",
        "boom\n[The command completed with exit code 127.]",
        "> x@1 test\n ELIFECYCLE  Command failed with exit code 1.",
        "{\"output\": \"\", \"metadata\": {\"exit_code\": 3}}",
    ];
    for i in 0..n {
        let id = format!("c{i}");
        let cmd = format!("rm -f tmp/a_{i}.log && mv b_{i}.txt c_{i}.txt && python3 -c \"open('d_{i}.json', 'w').write('1')\"");
        items.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
               "function": {"name": "bash", "arguments": json!({"command": cmd}).to_string()}}]}));
        items.push(
            json!({"role": "tool", "tool_call_id": id, "content": outputs[i % outputs.len()]}),
        );
        if i % 10 == 0 {
            items.push(json!({"role": "user", "content": [
                {"type": "text", "text": format!("<system-reminder>\nreminder {i}\n</system-reminder>")},
                {"type": "text", "text": format!("From now on, never touch vendor_{i}/.")}]}));
        }
    }
    items
}

/// The trail's extraction — the ledger's commands and files, the rules and
/// reminders — grows linearly with the history and stays bounded: its
/// lists are capped (what is left out counted), and the worst single
/// inputs (an `rm` of thousands of paths, a Python one-liner with thousands
/// of writes, a message of 100,000 unclosed reminders) are read within the
/// time bound, with bounded results.
#[test]
fn the_trail_is_extracted_in_linear_time_and_bounded() {
    use compactor::compaction::summary::{MAX_COMMANDS, MAX_RULES, MAX_SYSTEM_NOTES};
    let time = |n: usize| {
        let items = trail_history(n);
        let t = Instant::now();
        let facts = extract_facts(&items, None);
        (t.elapsed(), facts)
    };
    let (small, _) = time(500);
    let (large, facts) = time(4_000);
    eprintln!("the trail of 500 calls: {small:?}; of 4,000: {large:?}");
    assert!(
        large < small * 16 + Duration::from_millis(500),
        "8 times the history took {large:?} against {small:?}"
    );
    assert_eq!(facts.commands.len(), MAX_COMMANDS);
    assert_eq!(facts.commands.len() + facts.commands_dropped, 4_000);
    assert_eq!(
        facts.commands.last().unwrap().line(),
        "rm -f tmp/a_3999.log && mv b_3999.txt c_3999.txt && python3 -c \"open('d_3999.json', 'w').write('1')\" → [The command completed with exit code 127.]"
    );
    assert_eq!(facts.rules.len(), MAX_RULES);
    assert_eq!(facts.rules.len() + facts.rules_dropped, 400);
    assert_eq!(facts.system.len(), MAX_SYSTEM_NOTES);
    assert_eq!(facts.system.len() + facts.system_dropped, 400);
    let summary = assemble(&facts, None, 12_000, 48_000);
    assert!(summary.len() <= 48_000, "{}", summary.len());
    assert!(
        summary.contains("3960 earlier left out"),
        "the commands left out are counted"
    );

    let many_rm = format!(
        "rm {}",
        (0..50_000)
            .map(|i| format!("f{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let many_lines = (0..20_000)
        .map(|i| format!("rm g{i}.txt"))
        .collect::<Vec<_>>()
        .join("\n");
    let many_writes = format!(
        "python3 -c \"{}\"",
        "open('w.txt', 'w').write('x');".repeat(100_000)
    );
    let reminders = "<system-reminder>".repeat(100_000);
    for (name, cmd, user) in [
        ("an rm of 50,000 paths", many_rm.as_str(), ""),
        ("20,000 rm lines", many_lines.as_str(), ""),
        ("100,000 Python writes", many_writes.as_str(), ""),
        ("100,000 unclosed reminders", "true", reminders.as_str()),
    ] {
        let mut items = part(cmd, "<returncode>0</returncode>");
        items.push(json!({"role": "user", "content": format!("{user}Never push.")}));
        let t = Instant::now();
        let facts = extract_facts(&items, None);
        let took = t.elapsed();
        assert!(took < BAD_INPUT_TIME, "{name}: {took:?}");
        assert!(
            facts.files.len() <= 256,
            "{name}: {} files",
            facts.files.len()
        );
        assert!(facts.system.len() <= MAX_SYSTEM_NOTES, "{name}");
        assert!(
            facts.system.iter().all(|s| s.len() <= 2_000),
            "{name}: a reminder past its clip"
        );
        assert_eq!(facts.commands.len(), 1, "{name}");
        assert!(facts.commands[0].line().len() <= 400, "{name}");
        eprintln!("{name}: {took:?}, {} files", facts.files.len());
    }
}
