//! What a tool output says about its call: the exit status it states
//! (Codex's `Process exited with code N`, `Exit code: N`, JSON
//! `metadata.exit_code`) and, when it failed, its exact error lines
//! ([`is_error_line`]).

use serde_json::Value;

use std::borrow::Cow;

use super::failures::failures;
use super::limits::MAX_ERROR_LINE;
use super::text::{clip, str_field, value_or_json};
use crate::compaction::items::{ceil_boundary, floor_boundary};

/// Opens the digest line naming an output's paths.
const PATHS_NAMED: &str = "Paths named:";
/// Most paths a digest names.
const MAX_DIGEST_PATHS: usize = 5;
/// Longest path a digest names.
const MAX_DIGEST_PATH: usize = 160;

/// File extensions a path-like word without a `/` must end in to count.
const PATH_EXTENSIONS: [&str; 24] = [
    "rs", "py", "ts", "tsx", "js", "jsx", "go", "java", "kt", "c", "h", "cc", "cpp", "hpp", "rb",
    "toml", "json", "yaml", "yml", "md", "txt", "csv", "sh", "sql",
];

/// A word of an output that names a file (`crates/a/src/csv.rs:88:14:` →
/// `crates/a/src/csv.rs`).
fn path_in(word: &str) -> Option<&str> {
    let w = word.trim_matches(|c: char| "'\"`()[]{}<>,;".contains(c));
    // Drop `:line:col` and a trailing colon.
    let w = w.split(':').next().unwrap_or("");
    let w = w.trim_end_matches('.');
    let (stem, ext) = w.rsplit_once('.')?;
    let valid = !stem.is_empty()
        && !ext.is_empty()
        && ext.len() <= 8
        && ext.chars().all(|c| c.is_ascii_alphanumeric())
        && w.chars()
            .all(|c| c.is_alphanumeric() || "_-./@+".contains(c))
        && !w.contains("://")
        && w.len() <= MAX_DIGEST_PATH;
    let named = w.contains('/') || PATH_EXTENSIONS.contains(&ext);
    (valid && named && !ext.chars().all(|c| c.is_ascii_digit())).then_some(w)
}

/// A short digest of a tool output that is being cut, for the stub or
/// marker that replaces it: its exit status when it states one, its exact
/// error lines (those not in `kept`, the part of the output still shown),
/// and the paths it names (from its error lines first). Empty when there is
/// nothing to say.
pub fn output_digest(text: &str, kept: &str) -> Vec<String> {
    let o = outcome(text);
    let mut lines = Vec::new();
    if let Some(code) = o.exit {
        if stated_exit_code(kept) != Some(code) {
            // The words that stated it, unless they are a harness's header
            // (`Exit code N`, `Process exited with code N`): that one reads
            // the same for every harness.
            let words = status_words(text).filter(|w| {
                let lower = w.to_ascii_lowercase();
                !lower.starts_with("exit code") && !lower.starts_with("process exited")
            });
            lines.push(words.unwrap_or_else(|| format!("Exit code: {code}")));
        }
    }
    if o.failed {
        lines.extend(
            o.errors
                .iter()
                .filter(|e| !kept.contains(e.as_str()))
                .cloned(),
        );
    }
    let mut paths: Vec<&str> = Vec::new();
    let sources = o
        .errors
        .iter()
        .map(String::as_str)
        .chain(text.lines().take(MAX_DIGEST_SCAN_LINES));
    'scan: for line in sources {
        for w in line.split_whitespace() {
            if let Some(p) = path_in(w) {
                if !paths.contains(&p) {
                    paths.push(p);
                    if paths.len() == MAX_DIGEST_PATHS {
                        break 'scan;
                    }
                }
            }
        }
    }
    if !paths.is_empty() {
        lines.push(format!("{PATHS_NAMED} {}", paths.join(", ")));
    }
    lines
}

/// What a tool output says about its call.
#[derive(Debug, Clone, Default)]
pub(super) struct Outcome {
    pub(super) failed: bool,
    /// The output was replaced by the ladder's prune stub: status unknown.
    pub(super) pruned: bool,
    /// The failures' blocks, quoted as printed (at most
    /// [`MAX_FAILURES`](super::failures::MAX_FAILURES)).
    pub(super) errors: Vec<String>,
    pub(super) exit: Option<i64>,
    /// The words that stated the exit status ([`status_words`]).
    pub(super) status: Option<String>,
}

impl Outcome {
    /// A failure the harness flagged though the text did not say so: its
    /// failure blocks, or its last line.
    pub(super) fn failed_with(text: &str) -> Outcome {
        let mut errors: Vec<String> = failures(text).into_iter().map(|f| f.text).collect();
        if errors.is_empty() {
            if let Some(last) = text.lines().map(str::trim).rfind(|l| !l.is_empty()) {
                errors.push(clip(last, MAX_ERROR_LINE));
            }
        }
        Outcome {
            failed: true,
            pruned: false,
            errors,
            exit: stated_exit_code(text),
            status: status_words(text),
        }
    }
}

/// Header lines harnesses and our own ladder put around tool output.
fn is_header_line(t: &str) -> bool {
    const HEADERS: [&str; 12] = [
        "Chunk ID:",
        "Wall time:",
        "Process exited with code",
        "Original token count:",
        "Output:",
        "Exit code:",
        "Total output lines:",
        "[compactor:",
        "[… ",
        PATHS_NAMED,
        "<returncode>",
        "[The command completed with exit code",
    ];
    HEADERS.iter().any(|h| t.starts_with(h))
}

fn leading_int(s: &str) -> Option<i64> {
    let s = s.trim_start_matches([':', ' ', '=']);
    let end = s
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && c == '-')))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    s[..end].parse().ok()
}

/// Bytes read at each end of an output for a stated exit code.
const EXIT_SCAN_BYTES: usize = 8 * 1024;
/// Lines of an output read for the paths it names (after its failures).
const MAX_DIGEST_SCAN_LINES: usize = 2_000;

/// Longest statement of an exit status kept (its line, clipped).
const MAX_STATUS_WORDS: usize = 160;

/// An exit code stated by the output's own lines.
fn stated_exit_code(body: &str) -> Option<i64> {
    stated_exit(body).map(|(code, _)| code)
}

/// An exit status stated by the output's own lines, and the line that
/// states it, as printed: a header (Codex's `Process exited with code N`,
/// Claude Code's `Exit code N`, `Exit code: N`), a wrapper (a one-`bash`
/// agent's `<returncode>N</returncode>`), a trailer (OpenHands' `[The
/// command completed with exit code N.]`) or a runner's own line (pnpm's
/// and yarn's `Command failed with exit code N.`).
fn stated_exit(body: &str) -> Option<(i64, String)> {
    const PHRASES: [&str; 8] = [
        "process exited with code",
        "error: exit code",
        "exit code",
        "exit status",
        "exited with code",
        "exit_code",
        "<returncode>",
        "[the command completed with exit code",
    ];
    const ANYWHERE: &str = "command failed with exit code";
    // Harnesses state it in a header or a last line: the ends are read,
    // not the whole of a long log.
    let head = &body[..floor_boundary(body, EXIT_SCAN_BYTES)];
    let tail =
        &body[ceil_boundary(body, body.len().saturating_sub(EXIT_SCAN_BYTES)).max(head.len())..];
    head.lines().chain(tail.lines()).find_map(|l| {
        let t = l.trim();
        if t.len() > MAX_STATUS_WORDS * 4 {
            return None;
        }
        let lower = t.to_ascii_lowercase();
        let code = PHRASES
            .iter()
            .find_map(|p| lower.strip_prefix(p).and_then(leading_int))
            .or_else(|| {
                let at = lower.find(ANYWHERE)?;
                leading_int(&lower[at + ANYWHERE.len()..])
            })?;
        Some((code, clip(t, MAX_STATUS_WORDS)))
    })
}

/// How an output states its call's exit status, in its own words: the
/// line that states it, or the JSON wrapper's field as `exit_code: N`.
/// `None` when it states none.
pub(super) fn status_words(text: &str) -> Option<String> {
    if text.trim_start().starts_with('{') {
        if let Ok(v) = serde_json::from_str::<Value>(text) {
            if let Some(code) = json_exit(&v) {
                return Some(format!("exit_code: {code}"));
            }
            if let Some(out) = v.get("output").and_then(Value::as_str) {
                return stated_exit(out).map(|(_, w)| w);
            }
        }
    }
    stated_exit(text).map(|(_, w)| w)
}

/// Whether a (trimmed) output line reports a failure on its own: a marker
/// of one of the toolchains the summary module knows (compiler
/// diagnostics, exception lines, panics, test failures, shell errors, HTTP
/// error statuses, …).
pub fn is_error_line(t: &str) -> bool {
    !failures(t).is_empty()
}

/// The exit status a JSON wrapper states: Codex's `metadata.exit_code`,
/// `exit_code`, `exitCode`, `returncode`, `status` as a number.
fn json_exit(v: &Value) -> Option<i64> {
    v.pointer("/metadata/exit_code")
        .or_else(|| v.pointer("/metadata/exitCode"))
        .or_else(|| v.get("exit_code"))
        .or_else(|| v.get("exitCode"))
        .or_else(|| v.get("returncode"))
        .and_then(Value::as_i64)
}

/// Reads a tool output's payload.
pub(super) fn outcome(text: &str) -> Outcome {
    // A pruned output whose stub carries no digest says nothing of its call;
    // a digest is read like the output it stands for.
    if text.starts_with("[compactor: tool output pruned") && !text.trim_end().contains('\n') {
        return Outcome {
            pruned: true,
            ..Outcome::default()
        };
    }
    // JSON wrappers: Codex's {"output": "...", "metadata": {"exit_code": N}};
    // {"stdout", "stderr", "exit_code"}; {"error": "..."} / {"is_error": true}
    // / {"success": false}.
    let mut body: Cow<'_, str> = Cow::Borrowed(text);
    let mut exit = None;
    let mut flagged_line = None;
    if text.trim_start().starts_with('{') {
        if let Ok(v) = serde_json::from_str::<Value>(text) {
            let out = v.get("output").and_then(Value::as_str);
            let streams = [v.get("stdout"), v.get("stderr")]
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>();
            if let Some(out) = out {
                body = Cow::Owned(out.to_string());
            } else if !streams.is_empty() {
                body = Cow::Owned(streams.join("\n"));
            }
            exit = json_exit(&v);
            let error = v.get("error").filter(|e| !e.is_null() && **e != false);
            let flagged = v.get("is_error") == Some(&Value::Bool(true))
                || v.get("success") == Some(&Value::Bool(false));
            if error.is_some() || flagged {
                let line = error
                    .map(value_or_json)
                    .or_else(|| str_field(&v, &["message", "output", "stderr"]).map(String::from))
                    .unwrap_or_else(|| v.to_string());
                flagged_line = Some(line);
            }
        }
    }
    let exit = exit.or_else(|| stated_exit_code(&body));
    if let Some(line) = flagged_line {
        let mut errors: Vec<String> = failures(&line).into_iter().map(|f| f.text).collect();
        if errors.is_empty() {
            let first = line.trim().lines().next().unwrap_or("").trim();
            errors.push(clip(first, MAX_ERROR_LINE));
        }
        return Outcome {
            failed: true,
            pruned: false,
            errors,
            exit,
            status: status_words(text),
        };
    }
    let found = failures(&body);
    let meaningful = || {
        body.lines()
            .map(str::trim)
            .filter(|t| !t.is_empty() && !is_header_line(t))
    };
    let first = meaningful().next().unwrap_or("").to_ascii_lowercase();
    let says_failed = [
        "error",
        "failed",
        "failure",
        "fatal",
        "exception",
        "traceback",
    ]
    .iter()
    .any(|p| first.starts_with(p));
    let failed = match exit {
        Some(code) => code != 0,
        None => !found.is_empty() || says_failed,
    };
    let mut errors: Vec<String> = Vec::new();
    if failed {
        errors = found.into_iter().map(|f| f.text).collect();
        if errors.is_empty() {
            // Nothing looked like a failure: the last meaningful line says how it ended.
            if let Some(last) = meaningful().next_back() {
                errors.push(clip(last, MAX_ERROR_LINE));
            }
        }
    }
    Outcome {
        failed,
        pruned: false,
        errors,
        exit,
        status: exit.and(status_words(text)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;
    use serde_json::json;

    #[test]
    fn rust_errors_verbatim_and_exit_zero_is_ok() {
        let cargo = "Chunk ID: 9\nWall time: 2.0 seconds\nProcess exited with code 101\nOriginal token count: 80\nOutput:\n   Compiling demo v0.1.0\nerror[E0308]: mismatched types\n --> src/main.rs:3:18\n  |\n3 |     let x: u32 = \"a\";\n  |                  ^^^ expected `u32`, found `&str`\nerror: could not compile `demo` (bin \"demo\") due to 1 previous error\n";
        let grep = "Process exited with code 0\nOutput:\nsrc/lib.rs:10: // error: handled below\n";
        let part = vec![
            fc("a", "exec_command", json!({"cmd": "cargo build"})),
            fco("a", cargo),
            fc("b", "exec_command", json!({"cmd": "grep -rn error: src"})),
            fco("b", grep),
            fc("c", "exec_command", json!({"cmd": "false"})),
            fco("c", "Process exited with code 1\nOutput:\n"),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(
            f.errors,
            vec![
                "error[E0308]: mismatched types\n --> src/main.rs:3:18\n3 |     let x: u32 = \"a\";\n  |                  ^^^ expected `u32`, found `&str`".to_string(),
            ]
        );
        assert_eq!(
            f.tool_log[0],
            "exec_command(cmd=cargo build) → error (Process exited with code 101): error[E0308]: mismatched types"
        );
        assert!(f.tool_log[1].ends_with("→ ok"));
        assert!(f.tool_log[2].ends_with("→ error: Process exited with code 1"));
        // The ledger: each command with the words that stated its status.
        let lines: Vec<String> = f.commands.iter().map(|c| c.line()).collect();
        assert_eq!(
            lines,
            [
                "cargo build → Process exited with code 101",
                "grep -rn error: src → Process exited with code 0",
                "false → Process exited with code 1",
            ]
        );
    }

    /// A prune stub's digest keeps the exit status in the words of the
    /// output that stated it (a harness's own header reads `Exit code: N`),
    /// and the stub is read back with the same code.
    #[test]
    fn digests_keep_the_exit_status_in_each_harness_words() {
        for (output, words, code) in [
            (
                "<returncode>2</returncode>\n<output>\nboom\n</output>",
                "<returncode>2</returncode>",
                2,
            ),
            (
                "boom\n[The command completed with exit code 5.]\n[Current working directory: /w]",
                "[The command completed with exit code 5.]",
                5,
            ),
            (
                "> app@1.0.0 test\n> vitest run\n\n ELIFECYCLE  Command failed with exit code 1.\n",
                "ELIFECYCLE  Command failed with exit code 1.",
                1,
            ),
            (
                "Exit code 127\nbash: psql: command not found",
                "Exit code: 127",
                127,
            ),
            (
                "Chunk ID: 1\nProcess exited with code 3\nOutput:\n",
                "Exit code: 3",
                3,
            ),
            (
                r#"{"output": "", "metadata": {"exit_code": 4}}"#,
                "exit_code: 4",
                4,
            ),
        ] {
            let digest = output_digest(output, "");
            assert_eq!(digest.first().map(String::as_str), Some(words), "{output}");
            let stub = format!(
                "[compactor: tool output pruned (9 bytes)]\n{}",
                digest.join("\n")
            );
            assert_eq!(outcome(&stub).exit, Some(code), "{stub}");
        }
    }

    #[test]
    fn error_line_patterns() {
        for l in [
            "KeyError: 'session'",
            "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
            "AssertionError",
            "TypeError: x is not a function",
            "error[E0308]: mismatched types",
            "src/a.c:3:5: error: expected ';' before '}' token",
            "src/a.ts(1,7): error TS2322: Type 'string' is not assignable to type 'number'.",
            "thread 'main' panicked at src/main.rs:2:5:",
            "FAILED tests/test_auth.py::test_cookie - KeyError: 'session'",
            "bash: foo: command not found",
            "fatal: not a git repository (or any of the parent directories): .git",
        ] {
            assert!(is_error_line(l), "{l}");
        }
        for l in [
            "Compiling demo v0.1.0",
            "raise ValueError(msg)",
            "all 3 tests passed",
            "The error handling is fine",
        ] {
            assert!(!is_error_line(l), "{l}");
        }
        let json_err = outcome(r#"{"error": "ENOENT: no such file, open 'x.ts'"}"#);
        assert!(json_err.failed);
        assert_eq!(
            json_err.errors,
            vec!["ENOENT: no such file, open 'x.ts'".to_string()]
        );
        assert!(outcome(r#"{"is_error": true, "message": "denied"}"#).failed);
        assert!(!outcome(r#"{"ok": true, "error": null}"#).failed);
        // pytest's `E   ` lines are quoted as printed.
        let out = outcome("=== FAILURES ===\nE       KeyError: 'session'\n1 failed in 0.1s");
        assert!(out.failed);
        assert_eq!(out.errors, vec!["E       KeyError: 'session'".to_string()]);
    }
}
