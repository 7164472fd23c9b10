//! Rung 3, the pure half: the facts the proxy extracts itself, the
//! summarizer prompt, validation of the model's answer, and the assembled
//! summary message (or its deterministic fallback when the model failed).
//!
//! Hard facts never depend on the summarizer model's skill (DESIGN §6): the
//! task verbatim, the files the tool calls touched with what each now
//! contains (or the changes written to it), exact error lines of failed tool
//! calls, the latest plan and a one-line-per-call log are extracted here,
//! deterministically, and placed by [`assemble`] next to the six narrative
//! sections the model writes.
//!
//! Heuristics, all documented where they live:
//!
//! - task: the first real user message; harness-injected user messages
//!   (`<environment_context>`, `<user_instructions>`, `# AGENTS.md`, any
//!   message that is one `<tag>…</tag>` block, Codex's own compaction
//!   prompts) are skipped ([`is_injected`]).
//! - files: paths from call arguments (`path`, `file_path`, `filePath`, …),
//!   apply_patch envelopes (`*** Begin Patch`) anywhere in a call's
//!   arguments or custom-tool input, `cat > PATH <<EOF` heredocs in shell
//!   calls. A change is recorded only when its call did not fail. When the
//!   full content of a file is known (a write, or an `*** Add File`) later
//!   patches and old/new-string edits are applied to it, so the summary says
//!   what the file *now contains*; otherwise the changes written since are
//!   kept in order (capped).
//! - failure: a non-zero exit code when the output states one (Codex's
//!   `Process exited with code N`, `Exit code: N`, JSON `metadata.exit_code`);
//!   otherwise the presence of error-like lines ([`is_error_line`]).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::items::{
    ceil_boundary, floor_boundary, is_summary, is_tool_output, is_user_message, output_id, text_of,
    value_text, SUMMARY_MARKER,
};

/// Most error lines kept in [`Facts::errors`] (newest kept).
pub const MAX_ERRORS: usize = 20;
/// Most lines kept in [`Facts::tool_log`] (newest kept).
pub const MAX_TOOL_LOG: usize = 40;
/// Largest full file content kept per file (head and tail kept beyond it).
pub const MAX_FILE_CONTENT: usize = 32 * 1024;
/// Largest chain of patches/edits kept per file (newest kept).
pub const MAX_CHANGE_CHAIN: usize = 8 * 1024;
/// Error lines taken from one failed output.
const MAX_ERRORS_PER_OUTPUT: usize = 5;
/// Longest error line kept (longer ones are clipped with `…`).
const MAX_ERROR_LINE: usize = 400;
/// Longest `name(args)` part of a tool-log line.
const MAX_LOG_CALL: usize = 150;
/// Longest outcome part of a tool-log line.
const MAX_LOG_OUTCOME: usize = 150;

/// Facts the proxy extracts deterministically, so they survive any model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Facts {
    /// First real user message, verbatim.
    pub task: Option<String>,
    /// Files touched, ordered by first touch; one entry per path.
    pub files: Vec<FileFact>,
    /// Exact error lines from failed tool outputs (deduplicated, newest
    /// kept, at most [`MAX_ERRORS`]).
    pub errors: Vec<String>,
    /// Latest plan/todo list, rendered readably with statuses.
    pub plan: Option<String>,
    /// One line per tool call: `name(short args) → ok` or
    /// `→ error: <first error line>` (at most [`MAX_TOOL_LOG`], newest kept).
    pub tool_log: Vec<String>,
}

/// What the conversation did to one file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileFact {
    /// The path exactly as the tool call gave it (a leading `./` dropped).
    pub path: String,
    /// What `content` holds: `write` = the full current content is known;
    /// `patch` / `edit` = the patches / edits written since the last known
    /// full content, oldest first; `delete`; `read` (never modified here).
    pub action: String,
    /// Last full content, or the changes written (see `action`).
    pub content: Option<String>,
}

/// The narrative sections the model must write, as headings.
pub const NARRATIVE_SECTIONS: [&str; 6] = [
    "PLAN STATE",
    "DECISIONS",
    "FILE/WORKSPACE STATE",
    "CONSTRAINTS & PREFERENCES",
    "ERRORS & FIXES",
    "OPEN ITEMS / NEXT STEP",
];

/// A marker present in every summarizer system prompt (lets fakes and logs
/// recognise summary requests).
pub const SUMMARIZER_MARKER: &str = "[compactor-summarizer v1]";

/// Label that opens every block of proxy-recorded facts in an assembled
/// summary ([`previous_narrative`] cuts sections there).
const FACTS_LABEL: &str = "Recorded by the proxy";
/// Body of a narrative section in the deterministic fallback.
const UNAVAILABLE: &str = "(narrative unavailable)";
/// Body of a narrative section the model left out.
const NOT_PROVIDED: &str = "(not provided by the summarizer)";

// ---------------------------------------------------------------------------
// Small string helpers
// ---------------------------------------------------------------------------

/// `s` cut to at most `max` bytes (ending in `…` when cut).
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let end = floor_boundary(s, max.saturating_sub(3));
    format!("{}…", &s[..end])
}

/// `s` cut to at most `max` bytes keeping its head and tail, with a marker
/// naming the elided size in the middle.
fn head_tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let keep = max.saturating_sub(48);
    let head = floor_boundary(s, keep / 2);
    let tail = ceil_boundary(s, s.len() - (keep - keep / 2)).max(head);
    format!(
        "{}\n[… {} bytes elided …]\n{}",
        &s[..head],
        tail - head,
        &s[tail..]
    )
}

/// The first line of `s`, clipped.
fn first_line(s: &str, max: usize) -> String {
    let t = s.trim();
    let line = t.lines().next().unwrap_or("");
    if line.len() < t.len() {
        clip(&format!("{line}…"), max)
    } else {
        clip(line, max)
    }
}

fn role(item: &Value) -> &str {
    item.get("role").and_then(Value::as_str).unwrap_or("")
}

fn kind(item: &Value) -> &str {
    item.get("type").and_then(Value::as_str).unwrap_or("")
}

fn str_field<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| v.get(*k).and_then(Value::as_str))
}

/// Arguments as JSON when they parse, else the raw string.
fn parse_args(v: Option<&Value>) -> Value {
    match v {
        Some(Value::String(s)) => {
            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        Some(v) => v.clone(),
        None => Value::Null,
    }
}

/// Every string inside `v` (a few levels deep).
fn string_leaves<'a>(v: &'a Value, depth: usize, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) if depth > 0 => a.iter().for_each(|x| string_leaves(x, depth - 1, out)),
        Value::Object(o) if depth > 0 => o.values().for_each(|x| string_leaves(x, depth - 1, out)),
        _ => {}
    }
}

/// A code fence longer than any backtick run in `content`.
fn fence_for(content: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in content.chars() {
        if c == '`' {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    "`".repeat((longest + 1).max(3))
}

fn fenced(content: &str, lang: &str) -> String {
    let fence = fence_for(content);
    let nl = if content.ends_with('\n') { "" } else { "\n" };
    format!("{fence}{lang}\n{content}{nl}{fence}")
}

/// Lowercased name split into words (`read_file`, `readFile`, `Read`).
fn name_words(name: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in name.chars() {
        if !c.is_alphanumeric() {
            if !cur.is_empty() {
                words.push(std::mem::take(&mut cur));
            }
            prev_lower = false;
            continue;
        }
        if c.is_uppercase() && prev_lower && !cur.is_empty() {
            words.push(std::mem::take(&mut cur));
        }
        prev_lower = c.is_lowercase() || c.is_ascii_digit();
        cur.extend(c.to_lowercase());
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words
}

fn name_has(name: &str, words: &[&str]) -> bool {
    name_words(name).iter().any(|w| words.contains(&w.as_str()))
}

// ---------------------------------------------------------------------------
// Task
// ---------------------------------------------------------------------------

/// User messages a harness injects rather than the person typed. A small
/// heuristic: known prefixes (Codex, Claude Code, agents' instruction files,
/// compaction hand-offs), or a message that is one `<tag>…</tag>` block.
pub fn is_injected(text: &str) -> bool {
    const PREFIXES: [&str; 12] = [
        "<environment_context>",
        "<user_instructions>",
        "# AGENTS.md",
        "# CLAUDE.md",
        "<INSTRUCTIONS>",
        "<user_shell_command>",
        "<turn_aborted>",
        "<system-reminder>",
        "<command-name>",
        "Caveat: The messages below were generated by the user while running local commands",
        "Another language model started to solve this problem",
        "You are performing a CONTEXT CHECKPOINT COMPACTION",
    ];
    let t = text.trim();
    if t.is_empty() || PREFIXES.iter().any(|p| t.starts_with(p)) {
        return true;
    }
    // One whole `<tag …>…</tag>` block.
    if let Some(rest) = t.strip_prefix('<') {
        let tag: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
            .collect();
        if !tag.is_empty() && t.ends_with(&format!("</{tag}>")) {
            return true;
        }
    }
    false
}

/// TASK of an assembled summary (for a part that starts with a summary when
/// no previous facts were passed).
fn task_from_summary(text: &str) -> Option<String> {
    let start = text.find("\n## TASK\n")? + "\n## TASK\n".len();
    let end = text[start..]
        .find("\n\n## PLAN STATE\n")
        .map(|e| start + e)
        .unwrap_or(text.len());
    let task = &text[start..end];
    (!task.is_empty() && task != "(not recorded)").then(|| task.to_string())
}

// ---------------------------------------------------------------------------
// Tool calls and their outcomes
// ---------------------------------------------------------------------------

struct Call {
    id: String,
    name: String,
    args: Value,
    /// Outcome carried by the call item itself (hosted tools, `mcp_call`).
    inline: Option<Outcome>,
}

/// The tool calls an item makes, in both wire formats.
fn calls_of(item: &Value) -> Vec<Call> {
    if let Some(calls) = item.get("tool_calls").and_then(Value::as_array) {
        return calls
            .iter()
            .map(|c| {
                let f = c.get("function").unwrap_or(c);
                Call {
                    id: str_field(c, &["id"]).unwrap_or("").to_string(),
                    name: str_field(f, &["name"]).unwrap_or("tool").to_string(),
                    args: parse_args(f.get("arguments")),
                    inline: None,
                }
            })
            .collect();
    }
    let k = kind(item);
    if !k.ends_with("_call") {
        return Vec::new();
    }
    let id = str_field(item, &["call_id"]).unwrap_or("").to_string();
    let call = match k {
        "function_call" => Call {
            id,
            name: str_field(item, &["name"]).unwrap_or("function").to_string(),
            args: parse_args(item.get("arguments")),
            inline: None,
        },
        "custom_tool_call" => Call {
            id,
            name: str_field(item, &["name"])
                .unwrap_or("custom_tool")
                .to_string(),
            args: item.get("input").cloned().unwrap_or(Value::Null),
            inline: None,
        },
        "local_shell_call" => Call {
            id,
            name: "local_shell".to_string(),
            args: item.get("action").cloned().unwrap_or(Value::Null),
            inline: None,
        },
        _ => {
            // Hosted tools (web_search_call, mcp_call, …): the item is its own record.
            let error = item
                .get("error")
                .filter(|e| !e.is_null())
                .map(value_or_json);
            let failed = error.is_some() || str_field(item, &["status"]) == Some("failed");
            let args = item
                .get("action")
                .cloned()
                .unwrap_or_else(|| parse_args(item.get("arguments")));
            Call {
                id,
                name: str_field(item, &["name"]).unwrap_or(k).to_string(),
                args,
                inline: Some(Outcome {
                    failed,
                    pruned: false,
                    errors: error
                        .map(|e| vec![clip(e.trim(), MAX_ERROR_LINE)])
                        .unwrap_or_default(),
                    exit: None,
                }),
            }
        }
    };
    vec![call]
}

fn value_or_json(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => {
            let t = value_text(other);
            if t.is_empty() {
                other.to_string()
            } else {
                t
            }
        }
    }
}

/// Keys whose values are file contents: shown as a size in the tool log.
const BULKY_KEYS: [&str; 12] = [
    "content",
    "contents",
    "file_text",
    "new_string",
    "old_string",
    "newString",
    "oldString",
    "new_str",
    "old_str",
    "edits",
    "patch",
    "input",
];

/// Short rendering of a call's arguments for the tool log.
fn short_args(call: &Call) -> String {
    let patches = patch_files(&call.args);
    if !patches.is_empty() {
        let ops: Vec<String> = patches
            .iter()
            .map(|p| format!("{} {}", p.op, p.path))
            .collect();
        return format!("patch: {}", ops.join(", "));
    }
    let s = match &call.args {
        Value::Null => String::new(),
        Value::String(s) => first_line(s, 80),
        Value::Object(o) => o
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) if BULKY_KEYS.contains(&k.as_str()) && s.len() > 40 => {
                        format!("<{} bytes>", s.len())
                    }
                    Value::String(s) => first_line(s, 80),
                    Value::Array(a) if a.iter().all(Value::is_string) => first_line(
                        &a.iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(" "),
                        80,
                    ),
                    other => clip(&other.to_string(), 60),
                };
                format!("{k}={v}")
            })
            .collect::<Vec<_>>()
            .join(", "),
        other => clip(&other.to_string(), 80),
    };
    clip(&s, MAX_LOG_CALL)
}

/// What a tool output says about its call.
#[derive(Debug, Clone, Default)]
struct Outcome {
    failed: bool,
    /// The output was replaced by the ladder's prune stub: status unknown.
    pruned: bool,
    /// Exact error lines (at most [`MAX_ERRORS_PER_OUTPUT`]).
    errors: Vec<String>,
    exit: Option<i64>,
}

/// Header lines harnesses and our own ladder put around tool output.
fn is_header_line(t: &str) -> bool {
    const HEADERS: [&str; 9] = [
        "Chunk ID:",
        "Wall time:",
        "Process exited with code",
        "Original token count:",
        "Output:",
        "Exit code:",
        "Total output lines:",
        "[compactor:",
        "[… ",
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

/// An exit code stated by the output's own lines.
fn stated_exit_code(body: &str) -> Option<i64> {
    const PHRASES: [&str; 5] = [
        "process exited with code",
        "exit code",
        "exit status",
        "exited with code",
        "exit_code",
    ];
    body.lines().find_map(|l| {
        let lower = l.trim().to_ascii_lowercase();
        PHRASES
            .iter()
            .find_map(|p| lower.strip_prefix(p).and_then(leading_int))
    })
}

/// A Python/JS/Java-style exception line: `KeyError: 'session'`,
/// `json.decoder.JSONDecodeError: …`, `TypeError: x is not a function`.
fn is_exception_line(t: &str) -> bool {
    let t = t.strip_prefix("Uncaught ").unwrap_or(t);
    let name = t.split(':').next().unwrap_or("");
    let ident = !name.is_empty()
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '$');
    ident
        && (name.ends_with("Error") || name.ends_with("Exception"))
        && (name.len() == t.len() || t[name.len()..].starts_with(':'))
}

/// Whether a (trimmed) output line reports an error: compiler diagnostics
/// (`error[E0308]: …`, `file.c:3:5: error: …`, `a.ts(1,2): error TS…`),
/// exception lines, panics, test failures, shell errors.
pub fn is_error_line(t: &str) -> bool {
    let l = t.to_ascii_lowercase();
    const STARTS: [&str; 8] = [
        "error:",
        "error[",
        "fatal:",
        "fatal error",
        "panic:",
        "segmentation fault",
        "npm err!",
        "exception in thread",
    ];
    const CONTAINS: [&str; 9] = [
        ": error:",
        ": error ",
        "): error",
        "panicked at",
        "command not found",
        "no such file or directory",
        "permission denied",
        "verification failed",
        "undefined reference",
    ];
    STARTS.iter().any(|p| l.starts_with(p))
        || CONTAINS.iter().any(|p| l.contains(p))
        || t.starts_with("FAILED")
        || t.starts_with("FAIL ")
        || t.starts_with("--- FAIL")
        || t.starts_with("ERROR")
        || is_exception_line(t)
}

/// Reads a tool output's payload.
fn outcome(text: &str) -> Outcome {
    if text.starts_with("[compactor: tool output pruned") {
        return Outcome {
            pruned: true,
            ..Outcome::default()
        };
    }
    // Codex's JSON wrapper: {"output": "...", "metadata": {"exit_code": N}};
    // other tools answer {"error": "..."} / {"is_error": true} / {"success": false}.
    let mut body = text.to_string();
    let mut exit = None;
    if text.trim_start().starts_with('{') {
        if let Ok(v) = serde_json::from_str::<Value>(text) {
            if let Some(out) = v.get("output").and_then(Value::as_str) {
                body = out.to_string();
            }
            exit = v
                .pointer("/metadata/exit_code")
                .or_else(|| v.get("exit_code"))
                .and_then(Value::as_i64);
            let error = v.get("error").filter(|e| !e.is_null() && *e != false);
            let flagged = v.get("is_error") == Some(&Value::Bool(true))
                || v.get("success") == Some(&Value::Bool(false));
            if error.is_some() || flagged {
                let line = error
                    .map(value_or_json)
                    .or_else(|| str_field(&v, &["message", "output"]).map(String::from))
                    .unwrap_or_else(|| v.to_string());
                let line = line.trim().lines().next().unwrap_or("").trim();
                return Outcome {
                    failed: true,
                    pruned: false,
                    errors: vec![clip(line, MAX_ERROR_LINE)],
                    exit,
                };
            }
        }
    }
    let exit = exit.or_else(|| stated_exit_code(&body));
    let mut errors: Vec<String> = Vec::new();
    let meaningful = || {
        body.lines()
            .map(str::trim)
            .filter(|t| !t.is_empty() && !is_header_line(t))
    };
    for t in meaningful() {
        // pytest repeats the exception as `E       KeyError: 'session'`.
        let t = match t.strip_prefix("E ") {
            Some(rest) if is_exception_line(rest.trim()) => rest.trim(),
            _ => t,
        };
        if is_error_line(t) {
            let line = clip(t, MAX_ERROR_LINE);
            if !errors.contains(&line) {
                errors.push(line);
            }
            if errors.len() == MAX_ERRORS_PER_OUTPUT {
                break;
            }
        }
    }
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
        None => !errors.is_empty() || says_failed,
    };
    if !failed {
        errors.clear();
    } else if errors.is_empty() {
        // Nothing looked like an error: the last meaningful line says how it ended.
        if let Some(last) = meaningful().next_back() {
            errors.push(clip(last, MAX_ERROR_LINE));
        }
    }
    Outcome {
        failed,
        pruned: false,
        errors,
        exit,
    }
}

// ---------------------------------------------------------------------------
// File effects
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Read,
    Write(String),
    /// One file's section of an apply_patch envelope.
    Patch(String),
    /// An old/new string replacement (`old` empty: not applicable, e.g. insert).
    Edit {
        old: String,
        new: String,
        all: bool,
        rendered: String,
    },
    Delete,
}

#[derive(Debug, Clone, PartialEq)]
enum Effect {
    File(String, Op),
    Plan(String),
}

/// One file of an apply_patch envelope.
struct PatchFile {
    /// `A`, `U` or `D`.
    op: char,
    path: String,
    move_to: Option<String>,
    /// The section: its header line(s) and body.
    section: String,
    body: Vec<String>,
}

/// The files of every `*** Begin Patch … *** End Patch` envelope in `text`.
fn parse_patch(text: &str) -> Vec<PatchFile> {
    let mut files: Vec<PatchFile> = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        let t = line.trim_end();
        if t.trim_start() == "*** Begin Patch" {
            inside = true;
            continue;
        }
        if !inside {
            continue;
        }
        if t.trim_start() == "*** End Patch" {
            inside = false;
            continue;
        }
        let header = [
            ("*** Add File: ", 'A'),
            ("*** Update File: ", 'U'),
            ("*** Delete File: ", 'D'),
        ]
        .iter()
        .find_map(|(p, op)| t.strip_prefix(p).map(|path| (*op, path.trim())));
        if let Some((op, path)) = header {
            files.push(PatchFile {
                op,
                path: clean_path(path),
                move_to: None,
                section: t.to_string(),
                body: Vec::new(),
            });
            continue;
        }
        let Some(cur) = files.last_mut() else {
            continue;
        };
        if let Some(to) = t.strip_prefix("*** Move to: ") {
            cur.move_to = Some(clean_path(to.trim()));
        } else if t != "*** End of File" {
            cur.body.push(line.to_string());
        }
        cur.section.push('\n');
        cur.section.push_str(line);
    }
    files
}

/// Patch envelopes anywhere in a call's arguments (custom-tool input,
/// `command` arrays, `cmd` heredocs).
fn patch_files(args: &Value) -> Vec<PatchFile> {
    let mut leaves = Vec::new();
    string_leaves(args, 4, &mut leaves);
    leaves
        .into_iter()
        .filter(|s| s.contains("*** Begin Patch"))
        .flat_map(parse_patch)
        .collect()
}

/// Applies one Update section's hunks to `content`; `None` when a hunk's
/// old lines are not found (the caller then keeps the patch text instead).
fn apply_update(content: &str, body: &[String]) -> Option<String> {
    let mut lines: Vec<String> = content.lines().map(String::from).collect();
    let mut cursor = 0;
    // Hunks: (context header, old lines, new lines).
    let mut hunks: Vec<(Option<String>, Vec<String>, Vec<String>)> =
        vec![(None, Vec::new(), Vec::new())];
    for l in body {
        if let Some(h) = l.strip_prefix("@@") {
            let h = h.trim();
            hunks.push((
                (!h.is_empty()).then(|| h.to_string()),
                Vec::new(),
                Vec::new(),
            ));
            continue;
        }
        let hunk = hunks.last_mut().expect("one hunk at least");
        match l.chars().next() {
            Some('-') => hunk.1.push(l[1..].to_string()),
            Some('+') => hunk.2.push(l[1..].to_string()),
            Some(' ') => {
                hunk.1.push(l[1..].to_string());
                hunk.2.push(l[1..].to_string());
            }
            None => {
                hunk.1.push(String::new());
                hunk.2.push(String::new());
            }
            Some(_) => return None,
        }
    }
    for (ctx, old, new) in hunks {
        if old.is_empty() && new.is_empty() {
            continue;
        }
        let mut anchored = false;
        if let Some(ctx) = ctx {
            if let Some(i) = (cursor..lines.len()).find(|&i| lines[i].trim() == ctx) {
                cursor = i + 1;
                anchored = true;
            }
        }
        if old.is_empty() {
            let at = if anchored { cursor } else { lines.len() };
            lines.splice(at..at, new.iter().cloned());
            cursor = at + new.len();
            continue;
        }
        let matches = |i: usize, exact: bool| {
            old.iter().enumerate().all(|(j, o)| {
                let l = &lines[i + j];
                if exact {
                    l == o
                } else {
                    l.trim_end() == o.trim_end()
                }
            })
        };
        let last = lines.len().checked_sub(old.len())?;
        let at = (cursor..=last)
            .find(|&i| matches(i, true))
            .or_else(|| (cursor..=last).find(|&i| matches(i, false)))
            .or_else(|| (0..cursor.min(last + 1)).find(|&i| matches(i, false)))?;
        lines.splice(at..at + old.len(), new.iter().cloned());
        cursor = at + new.len();
    }
    let mut out = lines.join("\n");
    if content.ends_with('\n') || content.is_empty() {
        out.push('\n');
    }
    Some(out)
}

fn clean_path(p: &str) -> String {
    let p = p.trim().trim_matches(|c| c == '"' || c == '\'');
    p.strip_prefix("./").unwrap_or(p).to_string()
}

const PATH_KEYS: [&str; 10] = [
    "path",
    "file_path",
    "filePath",
    "filename",
    "file",
    "target_file",
    "absolute_path",
    "notebook_path",
    "relative_path",
    "file_name",
];

fn render_edit(old: &str, new: &str, all: bool) -> String {
    let mut s = String::from(if all {
        "@@ replace all\n"
    } else {
        "@@ replace\n"
    });
    for l in old.lines() {
        s.push('-');
        s.push_str(l);
        s.push('\n');
    }
    for l in new.lines() {
        s.push('+');
        s.push_str(l);
        s.push('\n');
    }
    s
}

fn edit_op(v: &Value, all_default: bool) -> Option<Op> {
    let old = str_field(
        v,
        &["old_string", "oldString", "old_str", "old_text", "search"],
    )?;
    let new = str_field(
        v,
        &["new_string", "newString", "new_str", "new_text", "replace"],
    )
    .unwrap_or("");
    let all = v
        .get("replace_all")
        .or_else(|| v.get("replaceAll"))
        .and_then(Value::as_bool)
        .unwrap_or(all_default);
    Some(Op::Edit {
        old: old.to_string(),
        new: new.to_string(),
        all,
        rendered: render_edit(old, new, all),
    })
}

/// `cat > PATH <<'EOF' … EOF` (or `cat <<EOF > PATH`) writes in a shell command.
fn heredoc_writes(cmd: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = cmd.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let Some(pos) = line.find("<<") else { continue };
        if !line.contains("cat") || line[pos..].starts_with("<<<") {
            continue;
        }
        let delim: String = line[pos + 2..]
            .trim_start_matches('-')
            .trim_start()
            .chars()
            .take_while(|c| !c.is_whitespace() && !";|&>".contains(*c))
            .filter(|c| !"'\"\\".contains(*c))
            .collect();
        // The redirect target: a single `>` (not `>>` append, not `2>&1`).
        let bytes = line.as_bytes();
        let target = (0..bytes.len()).find_map(|j| {
            let single = bytes[j] == b'>'
                && bytes.get(j + 1) != Some(&b'>')
                && bytes.get(j + 1) != Some(&b'&')
                && (j == 0 || !matches!(bytes[j - 1], b'>' | b'<' | b'0'..=b'9'));
            if !single {
                return None;
            }
            let rest = line[j + 1..].trim_start();
            let path: String = rest
                .chars()
                .take_while(|c| !c.is_whitespace() && !";|&<".contains(*c))
                .collect();
            let path = clean_path(&path);
            (!path.is_empty()).then_some(path)
        });
        if delim.is_empty() {
            continue;
        }
        let start = i;
        while i < lines.len() && lines[i].trim() != delim {
            i += 1;
        }
        if let Some(path) = target {
            if i < lines.len() && !line.contains(">>") {
                let mut content = lines[start..i].join("\n");
                content.push('\n');
                out.push((path, content));
            }
        }
        i += 1;
    }
    out
}

fn is_plan_tool(name: &str) -> bool {
    let words = name_words(name);
    let joined: String = words.concat();
    (joined.contains("todo") && !words.iter().any(|w| w == "read"))
        || matches!(
            joined.as_str(),
            "updateplan" | "setplan" | "createplan" | "plan" | "writeplan"
        )
}

/// A plan/todo call's arguments, rendered one step per line with its status
/// kept verbatim: `- [in_progress] Fix the cookie expiry`.
fn render_plan(args: &Value) -> String {
    let args = match args {
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        v => v.clone(),
    };
    let mut out: Vec<String> = Vec::new();
    if let Some(e) =
        str_field(&args, &["explanation", "summary", "title"]).filter(|e| !e.trim().is_empty())
    {
        out.push(e.trim().to_string());
    }
    let list = ["plan", "todos", "items", "steps", "tasks", "todoList"]
        .iter()
        .find_map(|k| args.get(*k).and_then(Value::as_array))
        .or_else(|| args.as_array());
    match list {
        Some(list) => {
            for entry in list {
                let text = match entry {
                    Value::String(s) => s.clone(),
                    e => str_field(
                        e,
                        &[
                            "step",
                            "content",
                            "description",
                            "title",
                            "task",
                            "text",
                            "name",
                        ],
                    )
                    .map(String::from)
                    .unwrap_or_else(|| e.to_string()),
                };
                let status = str_field(entry, &["status", "state"])
                    .map(String::from)
                    .or_else(|| {
                        entry
                            .get("completed")
                            .or_else(|| entry.get("done"))
                            .and_then(Value::as_bool)
                            .map(|d| {
                                if d {
                                    "completed".into()
                                } else {
                                    "pending".into()
                                }
                            })
                    });
                out.push(match status {
                    Some(s) => format!("- [{s}] {text}"),
                    None => format!("- {text}"),
                });
            }
        }
        None => match &args {
            Value::String(s) => out.push(s.clone()),
            Value::Object(o) => match o.get("plan").and_then(Value::as_str) {
                Some(p) => out.push(p.to_string()),
                None => out.push(args.to_string()),
            },
            Value::Null => {}
            other => out.push(other.to_string()),
        },
    }
    out.join("\n")
}

/// What a call does to files and the plan, if it succeeds.
fn effects_of(call: &Call) -> Vec<Effect> {
    let mut fx = Vec::new();
    let name = call.name.as_str();
    let args = &call.args;
    if is_plan_tool(name) {
        fx.push(Effect::Plan(render_plan(args)));
        return fx;
    }
    let patches = patch_files(args);
    if !patches.is_empty() {
        for p in patches {
            match p.op {
                'A' => {
                    let mut content: String = p
                        .body
                        .iter()
                        .map(|l| l.strip_prefix('+').unwrap_or(l))
                        .collect::<Vec<_>>()
                        .join("\n");
                    if !p.body.is_empty() {
                        content.push('\n');
                    }
                    fx.push(Effect::File(p.path, Op::Write(content)));
                }
                'D' => fx.push(Effect::File(p.path, Op::Delete)),
                _ => match p.move_to {
                    Some(to) => {
                        fx.push(Effect::File(p.path, Op::Delete));
                        fx.push(Effect::File(to, Op::Patch(p.section)));
                    }
                    None => fx.push(Effect::File(p.path, Op::Patch(p.section))),
                },
            }
        }
        return fx;
    }
    let shell_like = name == "local_shell"
        || name_has(
            name,
            &["shell", "exec", "bash", "command", "run", "terminal", "sh"],
        );
    if shell_like {
        let mut leaves = Vec::new();
        string_leaves(args, 3, &mut leaves);
        for s in leaves {
            for (path, content) in heredoc_writes(s) {
                fx.push(Effect::File(path, Op::Write(content)));
            }
        }
        return fx;
    }
    let Some(path) = str_field(args, &PATH_KEYS)
        .map(clean_path)
        .filter(|p| !p.is_empty())
    else {
        if name_has(name, &["read", "view", "open", "cat", "show"]) {
            for key in ["paths", "file_paths", "files"] {
                for p in args
                    .get(key)
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                {
                    fx.push(Effect::File(clean_path(p), Op::Read));
                }
            }
        }
        return fx;
    };
    let command = str_field(args, &["command"]).unwrap_or("");
    if let Some(edits) = args.get("edits").and_then(Value::as_array) {
        for e in edits {
            if let Some(op) = edit_op(e, false) {
                fx.push(Effect::File(path.clone(), op));
            }
        }
    } else if let Some(op) = edit_op(args, false) {
        fx.push(Effect::File(path, op));
    } else if command == "insert" {
        let text = str_field(args, &["insert_text", "new_str", "text"]).unwrap_or("");
        let line = args
            .get("insert_line")
            .map(Value::to_string)
            .unwrap_or_default();
        let mut rendered = format!("@@ insert after line {line}\n");
        for l in text.lines() {
            rendered.push_str(&format!("+{l}\n"));
        }
        fx.push(Effect::File(
            path,
            Op::Edit {
                old: String::new(),
                new: text.to_string(),
                all: false,
                rendered,
            },
        ));
    } else if let Some(content) =
        str_field(args, &["content", "contents", "file_text", "new_content"]).or_else(|| {
            name_has(name, &["write", "create", "save", "put"])
                .then(|| str_field(args, &["text", "data", "code"]))
                .flatten()
        })
    {
        if !name_has(name, &["read", "view", "search", "grep", "find"]) {
            fx.push(Effect::File(path, Op::Write(content.to_string())));
        }
    } else if command == "view" || name_has(name, &["read", "view", "open", "cat", "show"]) {
        fx.push(Effect::File(path, Op::Read));
    } else if name_has(name, &["delete", "remove", "rm", "unlink"]) {
        fx.push(Effect::File(path, Op::Delete));
    }
    fx
}

/// Appends a change to a file's chain of patches/edits, newest kept.
fn chain(prev: Option<&str>, change: &str) -> String {
    let mut s = match prev {
        Some(p) if !p.is_empty() => format!("{}\n{}", p.trim_end_matches('\n'), change),
        _ => change.to_string(),
    };
    if s.len() > MAX_CHANGE_CHAIN {
        let cut = ceil_boundary(&s, s.len() - MAX_CHANGE_CHAIN);
        let cut = s[cut..].find('\n').map(|i| cut + i + 1).unwrap_or(cut);
        s = format!("[… earlier changes elided …]\n{}", &s[cut..]);
    }
    s
}

fn apply_op(files: &mut Vec<FileFact>, path: String, op: Op) {
    let idx = match files.iter().position(|f| f.path == path) {
        Some(i) => i,
        None => {
            files.push(FileFact {
                path,
                action: "read".into(),
                content: None,
            });
            files.len() - 1
        }
    };
    let f = &mut files[idx];
    let known = (f.action == "write").then(|| f.content.clone()).flatten();
    let chained = matches!(f.action.as_str(), "patch" | "edit")
        .then(|| f.content.clone())
        .flatten();
    match op {
        Op::Read => {}
        Op::Delete => {
            f.action = "delete".into();
            f.content = None;
        }
        Op::Write(c) => {
            f.action = "write".into();
            f.content = Some(head_tail(&c, MAX_FILE_CONTENT));
        }
        Op::Patch(section) => {
            let body: Vec<String> = section
                .lines()
                .skip(1)
                .filter(|l| !l.starts_with("*** "))
                .map(String::from)
                .collect();
            match known.as_deref().and_then(|c| apply_update(c, &body)) {
                Some(new) => f.content = Some(head_tail(&new, MAX_FILE_CONTENT)),
                None => {
                    f.action = "patch".into();
                    f.content = Some(chain(chained.as_deref(), &section));
                }
            }
        }
        Op::Edit {
            old,
            new,
            all,
            rendered,
        } => {
            let applied = known
                .as_deref()
                .filter(|c| !old.is_empty() && c.contains(old.as_str()))
                .map(|c| {
                    if all {
                        c.replace(old.as_str(), &new)
                    } else {
                        c.replacen(old.as_str(), &new, 1)
                    }
                });
            match applied {
                Some(new) => f.content = Some(head_tail(&new, MAX_FILE_CONTENT)),
                None => {
                    f.action = "edit".into();
                    f.content = Some(chain(chained.as_deref(), &rendered));
                }
            }
        }
    }
}

fn push_error(errors: &mut Vec<String>, line: String) {
    errors.retain(|e| *e != line);
    errors.push(line);
    if errors.len() > MAX_ERRORS {
        errors.drain(..errors.len() - MAX_ERRORS);
    }
}

// ---------------------------------------------------------------------------
// extract_facts
// ---------------------------------------------------------------------------

struct Pending {
    line: usize,
    effects: Vec<Effect>,
}

fn settle(facts: &mut Facts, log: &mut [String], p: Pending, out: Option<&Outcome>) {
    let suffix = match out {
        None => "no output".to_string(),
        Some(o) if o.pruned => "output pruned".to_string(),
        Some(o) if o.failed => {
            let first = o
                .errors
                .first()
                .cloned()
                .or_else(|| o.exit.map(|c| format!("exit code {c}")))
                .unwrap_or_else(|| "failed".into());
            format!("error: {first}")
        }
        Some(_) => "ok".to_string(),
    };
    log[p.line] = format!("{} → {}", log[p.line], clip(&suffix, MAX_LOG_OUTCOME));
    if let Some(o) = out {
        if o.failed {
            for e in &o.errors {
                push_error(&mut facts.errors, e.clone());
            }
            return;
        }
    }
    for e in p.effects {
        match e {
            Effect::Plan(p) => facts.plan = Some(p),
            Effect::File(path, op) => apply_op(&mut facts.files, path, op),
        }
    }
}

/// Facts of `part` (the items being summarized), merged onto `previous`
/// (facts of the compaction this one extends): task kept, files merged by
/// path (newer wins; patches and edits apply onto a previously known full
/// content), errors and tool log appended and capped, plan replaced when a
/// newer one exists.
///
/// Changes are recorded only when their call did not fail; a call whose
/// output is not in `part` is assumed to have run (logged `→ no output`).
/// Pass the part before the ladder pruned it: pruned outputs carry no errors.
pub fn extract_facts(part: &[Value], previous: Option<&Facts>) -> Facts {
    let mut facts = previous.cloned().unwrap_or_default();
    let mut log: Vec<String> = Vec::new();
    let mut pending: HashMap<String, Pending> = HashMap::new();
    let mut unnamed: Vec<Pending> = Vec::new();
    for item in part {
        if facts.task.is_none() {
            if is_user_message(item) {
                let text = text_of(item);
                if !is_injected(&text) {
                    facts.task = Some(text);
                }
            } else if is_summary(item) {
                facts.task = task_from_summary(&text_of(item));
            }
        }
        for call in calls_of(item) {
            let line = log.len();
            log.push(format!("{}({})", call.name, short_args(&call)));
            let p = Pending {
                line,
                effects: effects_of(&call),
            };
            match (&call.inline, call.id.is_empty()) {
                (Some(o), _) => settle(&mut facts, &mut log, p, Some(o)),
                (None, true) => unnamed.push(p),
                (None, false) => {
                    pending.insert(call.id, p);
                }
            }
        }
        if is_tool_output(item) {
            let out = outcome(&text_of(item));
            match output_id(item).and_then(|id| pending.remove(id)) {
                Some(p) => settle(&mut facts, &mut log, p, Some(&out)),
                None if out.failed => out
                    .errors
                    .iter()
                    .for_each(|e| push_error(&mut facts.errors, e.clone())),
                None => {}
            }
        }
    }
    let mut left: Vec<Pending> = pending.into_values().chain(unnamed).collect();
    left.sort_by_key(|p| p.line);
    for p in left {
        settle(&mut facts, &mut log, p, None);
    }
    facts.tool_log.extend(log);
    if facts.tool_log.len() > MAX_TOOL_LOG {
        let drop = facts.tool_log.len() - MAX_TOOL_LOG;
        facts.tool_log.drain(..drop);
    }
    facts
}

// ---------------------------------------------------------------------------
// Transcript and prompt
// ---------------------------------------------------------------------------

/// One line/paragraph of transcript per item, for the summarizer: user and
/// assistant text, tool calls with their arguments, tool outputs (head and
/// tail kept within `max_item_bytes`), previous summaries labelled as such
/// (allowed 4× the size). Reasoning and opaque compaction items are skipped.
pub fn render_transcript(part: &[Value], max_item_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    for item in part {
        let k = kind(item);
        if matches!(k, "reasoning" | "compaction" | "compaction_trigger") {
            continue;
        }
        if is_summary(item) {
            out.push(format!(
                "[previous summary]\n{}",
                head_tail(&text_of(item), max_item_bytes.saturating_mul(4))
            ));
            continue;
        }
        if is_tool_output(item) {
            let id = output_id(item).unwrap_or("");
            out.push(format!(
                "[tool output {id}] {}",
                head_tail(&text_of(item), max_item_bytes)
            ));
            continue;
        }
        let mut lines = Vec::new();
        let r = role(item);
        if !r.is_empty() {
            let text = text_of(item);
            if !text.trim().is_empty() {
                lines.push(format!("[{r}] {}", head_tail(&text, max_item_bytes)));
            }
        }
        let calls = calls_of(item);
        for call in &calls {
            let args = match &call.args {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                v => v.to_string(),
            };
            let id = if call.id.is_empty() {
                String::new()
            } else {
                format!(" {}", call.id)
            };
            let mut line = format!(
                "[tool call {}{id}] {}",
                call.name,
                head_tail(&args, max_item_bytes)
            );
            if let Some(o) = &call.inline {
                line.push_str(if o.failed { " → failed" } else { " → done" });
            }
            lines.push(line);
        }
        if r.is_empty() && calls.is_empty() {
            // Unknown item type: its JSON minus opaque blobs.
            let mut v = item.clone();
            if let Some(o) = v.as_object_mut() {
                o.remove("encrypted_content");
            }
            lines.push(format!(
                "[{}] {}",
                if k.is_empty() { "item" } else { k },
                head_tail(&v.to_string(), max_item_bytes)
            ));
        }
        if !lines.is_empty() {
            out.push(lines.join("\n"));
        }
    }
    out
}

fn system_prompt() -> String {
    let sections = [
        "the current plan or todo list, each step with its status (done / in progress / pending).",
        "choices made and why, one line each.",
        "every file created, changed or deleted, by exact path, and what it now contains or was changed to (not just \"edited X\"); commands that worked.",
        "rules and preferences the user or the environment stated.",
        "errors hit, quoted exactly, and how each was fixed, or that it is unresolved.",
        "what remains to be done, and the very next action.",
    ];
    let list: String = NARRATIVE_SECTIONS
        .iter()
        .zip(sections)
        .map(|(h, what)| format!("## {h}\n{what}\n"))
        .collect();
    format!(
        "{SUMMARIZER_MARKER}\nYou write the hand-off summary of an earlier part of a conversation between a user and an AI assistant \
(often a coding agent using tools). Another model will continue the work from your summary alone, without the transcript.\n\n\
Write exactly these sections, in this order, each under its level-2 markdown heading written exactly as shown:\n\n{list}\n\
Rules:\n\
- Preserve exact file paths, names, identifiers, commands and error strings: copy them, do not paraphrase.\n\
- Never invent anything that is not in the transcript or the previous summary. If a section has nothing, write \"none\".\n\
- Be concise: short bullet lines. The proxy itself attaches the original task verbatim, file contents, the exact error list \
and the tool-call log, so do not copy long code or logs and do not restate the task.\n\
- Start directly with \"## {}\". No preamble, no closing remarks.\n",
        NARRATIVE_SECTIONS[0]
    )
}

/// The chat `messages` for one summarizer call: the system prompt (carrying
/// [`SUMMARIZER_MARKER`]) and a user message with the previous summary, when
/// chunking or re-compacting, and the transcript chunk.
pub fn summarizer_messages(previous_summary: Option<&str>, transcript: &str) -> Vec<Value> {
    let user = match previous_summary.filter(|s| !s.trim().is_empty()) {
        Some(prev) => format!(
            "Here is the summary so far:\n\n<previous_summary>\n{}\n</previous_summary>\n\n\
Update this summary with the new transcript below: keep what is still true, revise what changed, add what is new. \
Answer with the complete updated summary.\n\n<transcript>\n{}\n</transcript>",
            prev.trim(),
            transcript
        ),
        None => format!("Summarize this transcript.\n\n<transcript>\n{transcript}\n</transcript>"),
    };
    vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": user}),
    ]
}

// ---------------------------------------------------------------------------
// Reading the model's answer
// ---------------------------------------------------------------------------

/// Uppercase words, `&`/`and` and leading numbering dropped, joined.
fn normalize(s: &str) -> String {
    let upper = s.to_uppercase();
    let words: Vec<&str> = upper
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty() && *w != "AND")
        .collect();
    let skip = words
        .iter()
        .take_while(|w| w.chars().all(|c| c.is_ascii_digit()))
        .count();
    words[skip..].concat()
}

/// The narrative section a line opens, with any text written on the same
/// line (`**PLAN STATE:** done`). Headings are `#`…`######` lines, bold
/// lines, or a line that is just the heading (case-insensitive).
fn heading_of(line: &str) -> Option<(usize, String)> {
    let t = line.trim();
    let hashes = t.starts_with('#');
    let bold = t.starts_with("**") || t.starts_with("__");
    let norm = normalize(t);
    NARRATIVE_SECTIONS
        .iter()
        .position(|h| {
            let h = normalize(h);
            if hashes || bold {
                norm.starts_with(&h)
            } else {
                norm == h
            }
        })
        .map(|i| {
            let rest = if bold {
                t[2..]
                    .find(&t[..2])
                    .map(|e| {
                        t[2 + e + 2..]
                            .trim()
                            .trim_start_matches(':')
                            .trim()
                            .to_string()
                    })
                    .unwrap_or_default()
            } else {
                String::new()
            };
            (i, rest)
        })
}

fn is_fence(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("```") || t.starts_with("~~~")
}

/// Small models sometimes wrap their whole answer in a code fence.
fn unwrap_outer_fence(text: &str) -> &str {
    let t = text.trim();
    if !is_fence(t) {
        return text;
    }
    let Some((_, inner)) = t.split_once('\n') else {
        return text;
    };
    match inner.trim_end().rsplit_once('\n') {
        Some((body, last)) if is_fence(last) && last.trim().len() <= 4 => body,
        _ => text,
    }
}

/// The bodies of the narrative sections in `text` (`None` = heading absent).
/// Text before the first section is dropped; headings inside code fences are
/// not headings.
fn split_sections(text: &str) -> [Option<String>; 6] {
    let text = unwrap_outer_fence(text);
    let mut out: [Option<String>; 6] = Default::default();
    let mut current: Option<usize> = None;
    let mut fence = false;
    for line in text.lines() {
        if is_fence(line) {
            fence = !fence;
        } else if !fence {
            if let Some((i, rest)) = heading_of(line) {
                current = Some(i);
                let body = out[i].get_or_insert_with(String::new);
                if !rest.is_empty() {
                    body.push_str(&rest);
                    body.push('\n');
                }
                continue;
            }
        }
        if let Some(i) = current {
            let body = out[i].get_or_insert_with(String::new);
            body.push_str(line);
            body.push('\n');
        }
    }
    out.map(|b| b.map(|b| b.trim().to_string()))
}

/// Checks the model's answer: `Ok` if every [`NARRATIVE_SECTIONS`] heading is
/// present (`#`…`######`, bold, a bare line, any case, `and` for `&`,
/// numbering, trailing `:` all tolerated), else the missing headings.
pub fn validate(narrative: &str) -> Result<(), Vec<&'static str>> {
    let sections = split_sections(narrative);
    let missing: Vec<&'static str> = NARRATIVE_SECTIONS
        .iter()
        .zip(sections.iter())
        .filter(|(_, s)| s.is_none())
        .map(|(h, _)| *h)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing)
    }
}

// ---------------------------------------------------------------------------
// Assembling the summary message
// ---------------------------------------------------------------------------

/// The trimmable state of one assembled summary.
struct Draft<'a> {
    facts: &'a Facts,
    covered: usize,
    bodies: [String; 6],
    fallback: bool,
    plan: Option<String>,
    contents: Vec<Option<String>>,
    errors_from: usize,
    log_from: usize,
}

impl Draft<'_> {
    fn render(&self) -> String {
        let f = self.facts;
        let n = self.covered;
        let mut s = format!(
            "{SUMMARY_MARKER} of {n} earlier item{}]\nEarlier conversation items were compacted into this summary. \
Blocks starting \"{FACTS_LABEL}\" were extracted verbatim from the conversation; the rest was written by a model.\n",
            if n == 1 { "" } else { "s" }
        );
        if self.fallback {
            s.push_str("The model-written narrative is unavailable (the summarizer failed): only the facts the proxy recorded follow.\n");
        }
        s.push_str("\n## TASK\n");
        s.push_str(f.task.as_deref().unwrap_or("(not recorded)"));
        for (i, heading) in NARRATIVE_SECTIONS.iter().enumerate() {
            s.push_str(&format!("\n\n## {heading}\n{}", self.bodies[i]));
            let facts = match i {
                0 => self
                    .plan
                    .as_ref()
                    .map(|p| format!("{FACTS_LABEL}: the latest plan/todo list\n{p}")),
                2 => self.files_block(),
                4 => (self.errors_from < f.errors.len()).then(|| {
                    let errs = f.errors[self.errors_from..].join("\n");
                    format!(
                        "{FACTS_LABEL}: exact error lines from failed tool calls, oldest first\n{}",
                        fenced(&errs, "text")
                    )
                }),
                _ => None,
            };
            if let Some(block) = facts {
                s.push_str("\n\n");
                s.push_str(&block);
            }
        }
        s.push_str("\n\n## TOOL CALL LOG\n");
        let total = f.tool_log.len();
        if total == 0 {
            s.push_str("(no tool calls)");
        } else {
            let shown = total - self.log_from;
            s.push_str(&format!(
                "{FACTS_LABEL}: the last {shown} of {total} recorded tool calls, oldest first"
            ));
            for l in &f.tool_log[self.log_from..] {
                s.push_str("\n- ");
                s.push_str(l);
            }
        }
        s.push('\n');
        s
    }

    fn files_block(&self) -> Option<String> {
        if self.facts.files.is_empty() {
            return None;
        }
        let mut s = format!("{FACTS_LABEL}: files touched, in order of first touch");
        for (f, content) in self.facts.files.iter().zip(&self.contents) {
            let p = &f.path;
            let line = match (f.action.as_str(), content) {
                ("write", Some(c)) => format!("- {p} — current content:\n{}", fenced(c, "")),
                ("patch", Some(c)) => format!(
                    "- {p} — patched; the patches written, oldest first:\n{}",
                    fenced(c, "diff")
                ),
                ("edit", Some(c)) => format!(
                    "- {p} — edited; the edits written, oldest first:\n{}",
                    fenced(c, "diff")
                ),
                ("delete", _) => format!("- {p} — deleted"),
                ("read", _) => format!("- {p} — read, not modified"),
                (action, None) if f.content.is_some() => {
                    format!("- {p} — {action} (content omitted for size)")
                }
                (action, _) => format!("- {p} — {action}"),
            };
            s.push('\n');
            s.push_str(&line);
        }
        Some(s)
    }
}

/// The full summary message text: [`SUMMARY_MARKER`] header, `## TASK`
/// (verbatim), the six narrative sections with the proxy's facts after the
/// model's text in PLAN STATE (plan), FILE/WORKSPACE STATE (files with their
/// content or changes in fenced blocks) and ERRORS & FIXES (exact lines),
/// then `## TOOL CALL LOG`. `narrative = None` gives the deterministic
/// fallback: same headings, facts only, a line saying the narrative is
/// unavailable.
///
/// Within `max_bytes` by trimming, in order: the tool log (oldest first),
/// file contents (largest first, head and tail kept, then dropped — paths
/// always stay), errors (oldest first), then the narrative and the plan.
/// TASK and the file paths are never cut, so a task that alone exceeds the
/// budget yields a longer text.
pub fn assemble(
    facts: &Facts,
    narrative: Option<&str>,
    covered_items: usize,
    max_bytes: usize,
) -> String {
    let bodies: [String; 6] = match narrative {
        Some(n) => split_sections(n).map(|b| match b {
            Some(b) if !b.is_empty() => b,
            Some(_) => "none".to_string(),
            None => NOT_PROVIDED.to_string(),
        }),
        None => std::array::from_fn(|_| UNAVAILABLE.to_string()),
    };
    let mut d = Draft {
        facts,
        covered: covered_items,
        bodies,
        fallback: narrative.is_none(),
        plan: facts.plan.clone(),
        contents: facts.files.iter().map(|f| f.content.clone()).collect(),
        errors_from: 0,
        log_from: 0,
    };
    let mut text = d.render();
    let over = |t: &str| t.len().saturating_sub(max_bytes);
    // 1. The tool log, oldest lines first.
    while over(&text) > 0 && d.log_from < facts.tool_log.len() {
        d.log_from += 1;
        text = d.render();
    }
    // 2. File contents, largest first: shortened (head and tail), then dropped.
    for _ in 0..facts.files.len() * 3 + 1 {
        let excess = over(&text);
        if excess == 0 {
            break;
        }
        let Some((i, len)) = d
            .contents
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c.len())))
            .max_by_key(|&(_, len)| len)
        else {
            break;
        };
        d.contents[i] = if len > excess + 256 {
            Some(head_tail(
                d.contents[i].as_deref().unwrap_or(""),
                len - excess - 16,
            ))
        } else {
            None
        };
        text = d.render();
    }
    // 3. Errors, oldest first.
    while over(&text) > 0 && d.errors_from < facts.errors.len() {
        d.errors_from += 1;
        text = d.render();
    }
    // 4. The narrative (longest section first), then the plan.
    for _ in 0..24 {
        let excess = over(&text);
        if excess == 0 {
            break;
        }
        let (i, len) = d
            .bodies
            .iter()
            .map(String::len)
            .enumerate()
            .max_by_key(|&(_, l)| l)
            .unwrap_or((0, 0));
        if len <= 16 {
            break;
        }
        d.bodies[i] = clip(&d.bodies[i], len.saturating_sub(excess + 8).max(16));
        text = d.render();
    }
    if over(&text) > 0 {
        if let Some(p) = d.plan.as_deref() {
            let excess = over(&text);
            d.plan = Some(clip(p, p.len().saturating_sub(excess + 8).max(16)));
            text = d.render();
        }
    }
    text
}

/// The model-written sections of a previous assembled summary, for
/// re-compaction (the model updates them instead of re-reading raw history;
/// the facts are carried separately in [`Facts`]): each of the six
/// sections, cut before its `Recorded by the proxy` block, as `## HEADING`
/// blocks. When there is no narrative to carry (a deterministic fallback, or
/// a text not in this format) it returns the whole text after the header
/// line instead, so the model still sees the facts.
pub fn previous_narrative(summary_text: &str) -> String {
    let mut bodies: [Option<String>; 6] = Default::default();
    let mut current: Option<usize> = None;
    let mut fence = false;
    for line in summary_text.lines() {
        if is_fence(line) {
            fence = !fence;
        }
        let ours = line.starts_with("## ")
            && (heading_of(line).is_some()
                || matches!(line.trim_end(), "## TASK" | "## TOOL CALL LOG"));
        if !fence && !is_fence(line) && ours {
            current = heading_of(line).map(|(i, _)| i);
            if let Some(i) = current {
                bodies[i] = Some(String::new());
            }
            continue;
        }
        if !fence && line.starts_with(FACTS_LABEL) {
            current = None;
        }
        if let Some(i) = current {
            if let Some(b) = bodies[i].as_mut() {
                b.push_str(line);
                b.push('\n');
            }
        }
    }
    let has_narrative = bodies
        .iter()
        .flatten()
        .any(|b| !matches!(b.trim(), "" | "none" | UNAVAILABLE | NOT_PROVIDED));
    if !has_narrative {
        let body = match summary_text.split_once('\n') {
            Some((first, rest)) if first.starts_with(SUMMARY_MARKER) => rest,
            _ => summary_text,
        };
        return body.trim().to_string();
    }
    NARRATIVE_SECTIONS
        .iter()
        .zip(bodies)
        .map(|(h, b)| {
            let b = b
                .map(|b| b.trim().to_string())
                .filter(|b| !b.is_empty() && b != UNAVAILABLE && b != NOT_PROVIDED);
            format!("## {h}\n{}", b.unwrap_or_else(|| "none".into()))
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::items::user_message;
    use serde_json::json;

    fn chat_call(id: &str, name: &str, args: Value) -> Value {
        json!({"role": "assistant", "content": null,
               "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]})
    }

    fn chat_out(id: &str, content: &str) -> Value {
        json!({"role": "tool", "tool_call_id": id, "content": content})
    }

    fn fc(id: &str, name: &str, args: Value) -> Value {
        json!({"type": "function_call", "call_id": id, "name": name, "arguments": args.to_string()})
    }

    fn fco(id: &str, output: &str) -> Value {
        json!({"type": "function_call_output", "call_id": id, "output": output})
    }

    fn umsg(text: &str) -> Value {
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    }

    fn file<'a>(f: &'a Facts, path: &str) -> &'a FileFact {
        f.files
            .iter()
            .find(|x| x.path == path)
            .unwrap_or_else(|| panic!("no {path} in {:?}", f.files))
    }

    const AUTH_PATCH: &str = "*** Begin Patch\n*** Update File: src/auth.py\n@@ def check(cookie):\n-    max_age = 60\n+    max_age = 3600\n*** End Patch";
    const TRACEBACK: &str = "Traceback (most recent call last):\n  File \"app.py\", line 3, in <module>\n    s = req['session']\nKeyError: 'session'\n";

    #[test]
    fn chat_shape_task_write_keeps_last_content_and_errors() {
        let part = vec![
            json!({"role": "system", "content": "You are helpful."}),
            json!({"role": "user", "content": "Fix the login bug in app.py"}),
            chat_call(
                "c1",
                "write_file",
                json!({"path": "app.py", "content": "v1\n"}),
            ),
            chat_out("c1", "ok"),
            chat_call(
                "c2",
                "write_file",
                json!({"path": "./app.py", "content": "v2\n"}),
            ),
            chat_out("c2", "wrote 3 bytes"),
            chat_call("c3", "run", json!({"cmd": "python app.py"})),
            chat_out("c3", TRACEBACK),
            json!({"role": "user", "content": "try again"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.task.as_deref(), Some("Fix the login bug in app.py"));
        assert_eq!(f.files.len(), 1);
        assert_eq!(file(&f, "app.py").action, "write");
        assert_eq!(file(&f, "app.py").content.as_deref(), Some("v2\n"));
        assert_eq!(f.errors, vec!["KeyError: 'session'".to_string()]);
        assert_eq!(f.tool_log.len(), 3);
        assert!(
            f.tool_log[0].starts_with("write_file(path=app.py, content=v1"),
            "{:?}",
            f.tool_log
        );
        assert!(f.tool_log[0].ends_with("→ ok"));
        assert_eq!(
            f.tool_log[2],
            "run(cmd=python app.py) → error: KeyError: 'session'"
        );
    }

    #[test]
    fn responses_shape_apply_patch_custom_tool_call() {
        let part = vec![
            json!({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]}),
            umsg("<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"),
            umsg("# AGENTS.md instructions for /w\n\nbe nice"),
            umsg("Fix the expired cookie bug"),
            json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}),
            json!({"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": AUTH_PATCH}),
            json!({"type": "custom_tool_call_output", "call_id": "p1",
                   "output": "{\"output\":\"Success. Updated the following files:\\nM src/auth.py\\n\",\"metadata\":{\"exit_code\":0,\"duration_seconds\":0.0}}"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.task.as_deref(), Some("Fix the expired cookie bug"));
        let auth = file(&f, "src/auth.py");
        assert_eq!(auth.action, "patch");
        let c = auth.content.as_deref().unwrap();
        assert!(
            c.starts_with("*** Update File: src/auth.py") && c.contains("+    max_age = 3600"),
            "{c}"
        );
        assert!(f.errors.is_empty());
        assert_eq!(
            f.tool_log,
            vec!["apply_patch(patch: U src/auth.py) → ok".to_string()]
        );
    }

    #[test]
    fn patch_applies_onto_known_content_so_the_file_state_survives() {
        let add = "*** Begin Patch\n*** Add File: src/auth.py\n+def check(cookie):\n+    max_age = 60\n+    return cookie.age < max_age\n*** End Patch";
        let part = vec![
            umsg("fix it"),
            json!({"type": "custom_tool_call", "call_id": "a", "name": "apply_patch", "input": add}),
            json!({"type": "custom_tool_call_output", "call_id": "a", "output": "Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess."}),
            // Codex also runs apply_patch through its shell tool.
            fc("b", "exec_command", json!({"cmd": format!("apply_patch <<'EOF'\n{AUTH_PATCH}\nEOF")})),
            fco("b", "Chunk ID: 1\nWall time: 0.1 seconds\nProcess exited with code 0\nOutput:\nSuccess."),
        ];
        let f = extract_facts(&part, None);
        let auth = file(&f, "src/auth.py");
        assert_eq!(auth.action, "write");
        assert_eq!(
            auth.content.as_deref(),
            Some("def check(cookie):\n    max_age = 3600\n    return cookie.age < max_age\n")
        );
        assert_eq!(f.tool_log[1], "exec_command(patch: U src/auth.py) → ok");
    }

    #[test]
    fn patch_delete_move_and_failed_patch_not_recorded() {
        let patch = "*** Begin Patch\n*** Delete File: old.txt\n*** Update File: a.rs\n*** Move to: b.rs\n@@\n-x\n+y\n*** End Patch";
        let bad = "*** Begin Patch\n*** Update File: c.rs\n@@\n-nope\n+yes\n*** End Patch";
        let part = vec![
            json!({"type": "custom_tool_call", "call_id": "1", "name": "apply_patch", "input": patch}),
            json!({"type": "custom_tool_call_output", "call_id": "1", "output": "Success."}),
            json!({"type": "custom_tool_call", "call_id": "2", "name": "apply_patch", "input": bad}),
            json!({"type": "custom_tool_call_output", "call_id": "2", "output": "apply_patch verification failed: Failed to find expected lines in c.rs:\nnope"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(file(&f, "old.txt").action, "delete");
        assert_eq!(file(&f, "a.rs").action, "delete");
        assert!(file(&f, "b.rs")
            .content
            .as_deref()
            .unwrap()
            .contains("*** Move to: b.rs"));
        assert!(f.files.iter().all(|x| x.path != "c.rs"));
        assert_eq!(
            f.errors,
            vec![
                "apply_patch verification failed: Failed to find expected lines in c.rs:"
                    .to_string()
            ]
        );
        assert!(f.tool_log[1].contains("→ error: apply_patch verification failed"));
    }

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
                "error[E0308]: mismatched types".to_string(),
                "error: could not compile `demo` (bin \"demo\") due to 1 previous error"
                    .to_string()
            ]
        );
        assert_eq!(
            f.tool_log[0],
            "exec_command(cmd=cargo build) → error: error[E0308]: mismatched types"
        );
        assert!(f.tool_log[1].ends_with("→ ok"));
        assert!(f.tool_log[2].ends_with("→ error: exit code 1"));
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
        // pytest's `E   ` prefix is stripped to the exact exception line.
        let out = outcome("=== FAILURES ===\nE       KeyError: 'session'\n1 failed in 0.1s");
        assert!(out.failed);
        assert_eq!(out.errors, vec!["KeyError: 'session'".to_string()]);
    }

    #[test]
    fn plan_tools_rendered_with_statuses_latest_wins() {
        let plan1 = json!({"explanation": "start", "plan": [{"step": "Reproduce", "status": "in_progress"}, {"step": "Fix cookie", "status": "pending"}]});
        let plan2 = json!({"plan": [{"step": "Reproduce", "status": "completed"}, {"step": "Fix cookie", "status": "in_progress"}]});
        let part = vec![
            fc("1", "update_plan", plan1),
            fco("1", "Plan updated"),
            fc("2", "update_plan", plan2),
            fco("2", "Plan updated"),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(
            f.plan.as_deref(),
            Some("- [completed] Reproduce\n- [in_progress] Fix cookie")
        );
        // Claude Code's TodoWrite, chat shape.
        let todo = json!({"todos": [{"content": "Write tests", "status": "pending", "activeForm": "Writing tests"}]});
        let f2 = extract_facts(
            &[chat_call("t", "TodoWrite", todo), chat_out("t", "ok")],
            Some(&f),
        );
        assert_eq!(f2.plan.as_deref(), Some("- [pending] Write tests"));
        let f3 = extract_facts(&[json!({"role": "user", "content": "more"})], Some(&f2));
        assert_eq!(f3.plan, f2.plan, "no newer plan: kept");
    }

    #[test]
    fn edits_apply_to_known_content_else_chain() {
        let part = vec![
            chat_call(
                "w",
                "Write",
                json!({"file_path": "/r/a.py", "content": "x = 1\ny = 2\n"}),
            ),
            chat_out("w", "File created"),
            chat_call(
                "e",
                "Edit",
                json!({"file_path": "/r/a.py", "old_string": "y = 2", "new_string": "y = 3"}),
            ),
            chat_out("e", "ok"),
            chat_call(
                "m",
                "MultiEdit",
                json!({"file_path": "/r/b.py", "edits": [{"old_string": "a", "new_string": "b"}, {"old_string": "c", "new_string": "d"}]}),
            ),
            chat_out("m", "ok"),
            chat_call("r", "Read", json!({"file_path": "/r/c.py"})),
            chat_out("r", "1\tprint()"),
            chat_call("r2", "Read", json!({"file_path": "/r/a.py"})),
            chat_out("r2", "x = 1"),
        ];
        let f = extract_facts(&part, None);
        let paths: Vec<&str> = f.files.iter().map(|x| x.path.as_str()).collect();
        assert_eq!(paths, ["/r/a.py", "/r/b.py", "/r/c.py"]);
        assert_eq!(
            file(&f, "/r/a.py").content.as_deref(),
            Some("x = 1\ny = 3\n")
        );
        assert_eq!(
            file(&f, "/r/a.py").action,
            "write",
            "a read does not downgrade a known file"
        );
        let b = file(&f, "/r/b.py");
        assert_eq!(b.action, "edit");
        assert_eq!(
            b.content.as_deref(),
            Some("@@ replace\n-a\n+b\n@@ replace\n-c\n+d\n")
        );
        assert_eq!(file(&f, "/r/c.py").action, "read");
    }

    #[test]
    fn local_shell_heredoc_write_and_json_exit_code() {
        let cmd = "cat > notes/todo.md <<'EOF'\n# Todo\n- ship\nEOF";
        let part = vec![
            json!({"type": "local_shell_call", "call_id": "s", "status": "completed",
                   "action": {"type": "exec", "command": ["bash", "-lc", cmd]}}),
            json!({"type": "local_shell_call_output", "call_id": "s", "output": "{\"output\":\"\",\"metadata\":{\"exit_code\":0}}"}),
            json!({"type": "local_shell_call", "call_id": "t", "status": "completed",
                   "action": {"type": "exec", "command": ["bash", "-lc", "cat > x.txt <<EOF\nhi\nEOF"]}}),
            json!({"type": "local_shell_call_output", "call_id": "t", "output": "{\"output\":\"bash: x.txt: Permission denied\\n\",\"metadata\":{\"exit_code\":1}}"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.files.len(), 1);
        assert_eq!(
            file(&f, "notes/todo.md").content.as_deref(),
            Some("# Todo\n- ship\n")
        );
        assert_eq!(f.errors, vec!["bash: x.txt: Permission denied".to_string()]);
        assert!(
            f.tool_log[0]
                .starts_with("local_shell(type=exec, command=bash -lc cat > notes/todo.md"),
            "{:?}",
            f.tool_log
        );
    }

    #[test]
    fn facts_merge_across_two_compactions() {
        let first = vec![
            json!({"role": "user", "content": "Build the CLI"}),
            chat_call(
                "1",
                "write_file",
                json!({"path": "cli.py", "content": "print('a')\n"}),
            ),
            chat_out("1", "ok"),
            chat_call("2", "run", json!({"cmd": "python cli.py --x"})),
            chat_out(
                "2",
                "Traceback (most recent call last):\nNameError: name 'x' is not defined",
            ),
        ];
        let f1 = extract_facts(&first, None);
        let summary = assemble(&f1, None, first.len(), 10_000);
        let second = vec![
            user_message(summary),
            json!({"role": "user", "content": "Now add --verbose"}),
            chat_call(
                "3",
                "apply_patch",
                json!({"input": "*** Begin Patch\n*** Update File: cli.py\n@@\n-print('a')\n+print('b')\n*** End Patch"}),
            ),
            chat_out("3", "Done!"),
            chat_call(
                "4",
                "write_file",
                json!({"path": "README.md", "content": "# cli\n"}),
            ),
            chat_out("4", "ok"),
            chat_call("5", "run", json!({"cmd": "python cli.py"})),
            chat_out(
                "5",
                "Traceback (most recent call last):\nNameError: name 'x' is not defined",
            ),
        ];
        let f2 = extract_facts(&second, Some(&f1));
        assert_eq!(f2.task.as_deref(), Some("Build the CLI"), "task kept");
        assert_eq!(
            f2.files.iter().map(|x| x.path.as_str()).collect::<Vec<_>>(),
            ["cli.py", "README.md"]
        );
        assert_eq!(
            file(&f2, "cli.py").content.as_deref(),
            Some("print('b')\n"),
            "newer wins, patch applied"
        );
        assert_eq!(
            f2.errors,
            vec!["NameError: name 'x' is not defined".to_string()],
            "deduplicated"
        );
        assert_eq!(f2.tool_log.len(), 5, "appended");
        assert!(f2.tool_log[..2] == f1.tool_log[..]);
        // Without previous facts the task is read back from the summary item.
        let f3 = extract_facts(&second, None);
        assert_eq!(f3.task.as_deref(), Some("Build the CLI"));
    }

    #[test]
    fn errors_and_log_are_capped_newest_kept() {
        let mut part = Vec::new();
        for i in 0..50 {
            part.push(fc(&format!("c{i}"), "sh", json!({"cmd": format!("t{i}")})));
            part.push(fco(
                &format!("c{i}"),
                &format!(
                    "Process exited with code 1\nOutput:\nValueError: bad {}",
                    i % 25
                ),
            ));
        }
        let f = extract_facts(&part, None);
        assert_eq!(f.errors.len(), MAX_ERRORS);
        assert_eq!(f.errors.last().unwrap(), "ValueError: bad 24");
        assert_eq!(f.errors[0], "ValueError: bad 5");
        assert_eq!(f.tool_log.len(), MAX_TOOL_LOG);
        assert!(f.tool_log.last().unwrap().starts_with("sh(cmd=t49)"));
    }

    #[test]
    fn injected_user_messages_are_not_the_task() {
        assert!(is_injected(
            "<environment_context>\n<cwd>/x</cwd>\n</environment_context>"
        ));
        assert!(is_injected(
            "<user_instructions>\nbe terse\n</user_instructions>"
        ));
        assert!(is_injected("# AGENTS.md instructions for /repo"));
        assert!(is_injected("<custom_tag>whatever</custom_tag>"));
        assert!(!is_injected("Please fix <b>this</b> bug"));
        assert!(!is_injected("turn1: say hi"));
        let f = extract_facts(
            &[umsg("<environment_context>x</environment_context>")],
            None,
        );
        assert_eq!(f.task, None);
    }

    #[test]
    fn transcript_renders_both_shapes() {
        let big = format!("HEAD{}TAIL", "x".repeat(5000));
        let part = vec![
            json!({"role": "user", "content": "hello"}),
            chat_call("c1", "read_file", json!({"path": "a.py"})),
            chat_out("c1", &big),
            json!({"type": "reasoning", "encrypted_content": "SECRET"}),
            fc("f1", "exec_command", json!({"cmd": "ls"})),
            fco("f1", "README.md"),
            json!({"type": "custom_tool_call", "call_id": "p", "name": "apply_patch", "input": AUTH_PATCH}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}),
            user_message(format!("{SUMMARY_MARKER} of 3 earlier items]\n## TASK\nx")),
            json!({"type": "web_search_call", "id": "ws", "status": "completed", "action": {"type": "search", "query": "rust"}}),
        ];
        let t = render_transcript(&part, 200);
        assert_eq!(t.len(), 9, "{t:#?}");
        assert_eq!(t[0], "[user] hello");
        assert_eq!(t[1], "[tool call read_file c1] {\"path\":\"a.py\"}");
        assert!(
            t[2].starts_with("[tool output c1] HEAD") && t[2].ends_with("TAIL") && t[2].len() < 300,
            "{}",
            t[2]
        );
        assert!(t[2].contains("bytes elided"));
        assert!(!t.iter().any(|l| l.contains("SECRET")));
        assert_eq!(t[3], "[tool call exec_command f1] {\"cmd\":\"ls\"}");
        assert_eq!(t[4], "[tool output f1] README.md");
        assert!(t[5].starts_with("[tool call apply_patch p] *** Begin Patch"));
        assert_eq!(t[6], "[assistant] done");
        assert!(t[7].starts_with("[previous summary]\n[compactor summary of 3"));
        assert!(
            t[8].starts_with("[tool call web_search_call] {") && t[8].ends_with("→ done"),
            "{}",
            t[8]
        );
    }

    #[test]
    fn summarizer_prompt_has_marker_sections_and_previous_summary() {
        let m = summarizer_messages(None, "[user] hi");
        assert_eq!(m.len(), 2);
        assert_eq!(m[0]["role"], "system");
        let sys = m[0]["content"].as_str().unwrap();
        assert!(sys.contains(SUMMARIZER_MARKER));
        for h in NARRATIVE_SECTIONS {
            assert!(sys.contains(&format!("## {h}\n")), "{h}");
        }
        assert!(sys.contains("exact") && sys.contains("Never invent"));
        let u = m[1]["content"].as_str().unwrap();
        assert!(u.contains("[user] hi") && !u.contains("previous_summary"));
        let m2 = summarizer_messages(Some("## PLAN STATE\nold"), "[user] more");
        let u2 = m2[1]["content"].as_str().unwrap();
        assert!(
            u2.contains("## PLAN STATE\nold")
                && u2.contains("Update this summary")
                && u2.contains("[user] more")
        );
    }

    const GOOD: &str = "## PLAN STATE\n- fix cookie (in progress)\n\n## DECISIONS\n- max_age 3600: sessions last an hour\n\n## FILE/WORKSPACE STATE\n- src/auth.py: max_age now 3600\n\n## CONSTRAINTS & PREFERENCES\n- no new deps\n\n## ERRORS & FIXES\n- `KeyError: 'session'` fixed by default\n\n## OPEN ITEMS / NEXT STEP\n- run tests\n";

    #[test]
    fn validate_accepts_varied_heading_styles() {
        assert_eq!(validate(GOOD), Ok(()));
        let varied = "Here is the summary.\n### 1. Plan state\nx\n**Decisions:** chose y\n# file / workspace state\nz\n__Constraints and Preferences__\nnone\nERRORS & FIXES:\nnone\n## Open items / next steps\nrun it\n";
        assert_eq!(validate(varied), Ok(()));
        assert_eq!(validate(&format!("```markdown\n{GOOD}```\n")), Ok(()));
        let sections = split_sections(varied);
        assert_eq!(sections[1].as_deref(), Some("chose y"));
        assert_eq!(sections[5].as_deref(), Some("run it"));
    }

    #[test]
    fn validate_reports_missing_headings() {
        let partial = "## PLAN STATE\nx\n## DECISIONS\ny\n- errors & fixes are discussed here\n```\n## OPEN ITEMS / NEXT STEP\n```\n";
        assert_eq!(
            validate(partial),
            Err(vec![
                "FILE/WORKSPACE STATE",
                "CONSTRAINTS & PREFERENCES",
                "ERRORS & FIXES",
                "OPEN ITEMS / NEXT STEP"
            ])
        );
        assert_eq!(validate(""), Err(NARRATIVE_SECTIONS.to_vec()));
    }

    fn sample_facts() -> Facts {
        let part = vec![
            umsg("Fix the expired cookie bug in src/auth.py; keep the API unchanged."),
            fc(
                "u",
                "update_plan",
                json!({"plan": [{"step": "Fix", "status": "in_progress"}]}),
            ),
            fco("u", "Plan updated"),
            json!({"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": AUTH_PATCH}),
            json!({"type": "custom_tool_call_output", "call_id": "p1", "output": "Success."}),
            fc("t", "exec_command", json!({"cmd": "pytest"})),
            fco(
                "t",
                &format!("Process exited with code 1\nOutput:\n{TRACEBACK}"),
            ),
        ];
        extract_facts(&part, None)
    }

    #[test]
    fn assemble_places_facts_in_their_sections() {
        let f = sample_facts();
        let s = assemble(&f, Some(&format!("Sure! Here it is:\n{GOOD}")), 41, 100_000);
        if std::env::var_os("SHOW_SUMMARY").is_some() {
            eprintln!("{s}\n-----\n{}", assemble(&f, None, 41, 100_000));
        }
        assert!(
            s.starts_with("[compactor summary of 41 earlier items]\n"),
            "{s}"
        );
        assert!(is_summary(&user_message(s.clone())));
        assert!(!s.contains("Sure!"), "preamble dropped");
        let at = |h: &str| {
            s.find(&format!("\n## {h}\n"))
                .unwrap_or_else(|| panic!("{h} missing in {s}"))
        };
        let order: Vec<usize> = ["TASK"]
            .iter()
            .chain(NARRATIVE_SECTIONS.iter())
            .chain(["TOOL CALL LOG"].iter())
            .map(|h| at(h))
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        assert!(s.contains(
            "## TASK\nFix the expired cookie bug in src/auth.py; keep the API unchanged.\n"
        ));
        let plan = s.find("- [in_progress] Fix").unwrap();
        assert!(plan > at("PLAN STATE") && plan < at("DECISIONS"));
        let patch = s.find("+    max_age = 3600").unwrap();
        assert!(patch > at("FILE/WORKSPACE STATE") && patch < at("CONSTRAINTS & PREFERENCES"));
        assert!(s.contains("- src/auth.py — patched"));
        let err = s.find("```text\nKeyError: 'session'\n```").unwrap();
        assert!(err > at("ERRORS & FIXES") && err < at("OPEN ITEMS / NEXT STEP"));
        assert!(s.contains("- max_age 3600: sessions last an hour"));
        assert!(s.contains("- exec_command(cmd=pytest) → error: KeyError: 'session'"));
        assert!(s.len() <= 100_000);
    }

    #[test]
    fn assemble_fallback_is_facts_only() {
        let f = sample_facts();
        let s = assemble(&f, None, 7, 100_000);
        assert!(s.starts_with("[compactor summary of 7 earlier items]"));
        assert!(s.contains("narrative is unavailable"));
        for h in ["TASK"]
            .iter()
            .chain(NARRATIVE_SECTIONS.iter())
            .chain(["TOOL CALL LOG"].iter())
        {
            assert!(s.contains(&format!("\n## {h}\n")), "{h}");
        }
        assert!(
            s.contains("+    max_age = 3600")
                && s.contains("KeyError: 'session'")
                && s.contains("- [in_progress] Fix")
        );
        // A narrative missing sections still yields every heading.
        let s2 = assemble(&f, Some("## DECISIONS\nonly this"), 7, 100_000);
        assert!(s2.contains("## PLAN STATE\n(not provided by the summarizer)"));
        assert!(s2.contains("## DECISIONS\nonly this"));
    }

    #[test]
    fn assemble_within_budget_keeps_task_and_every_path() {
        let mut f = Facts {
            task: Some("Refactor the storage layer".into()),
            plan: Some("- [pending] everything".into()),
            ..Facts::default()
        };
        for i in 0..10 {
            f.files.push(FileFact {
                path: format!("src/module_{i}.rs"),
                action: "write".into(),
                content: Some(format!("// {i}\n{}", "fn x() {}\n".repeat(400))),
            });
        }
        f.files.push(FileFact {
            path: "gone.rs".into(),
            action: "delete".into(),
            content: None,
        });
        f.errors = (0..20)
            .map(|i| format!("error[E{i:04}]: something {}", "x".repeat(100)))
            .collect();
        f.tool_log = (0..40)
            .map(|i| format!("exec_command(cmd=step {i}) → ok {}", "y".repeat(100)))
            .collect();
        let full = assemble(&f, Some(GOOD), 100, usize::MAX);
        assert!(full.len() > 40_000);
        for max in [30_000, 8_000, 3_000] {
            let s = assemble(&f, Some(GOOD), 100, max);
            assert!(s.len() <= max, "{} > {max}", s.len());
            assert!(s.contains("## TASK\nRefactor the storage layer\n"));
            for x in &f.files {
                assert!(
                    s.contains(&format!("- {} —", x.path)),
                    "{} missing at {max}",
                    x.path
                );
            }
        }
        // The tool log goes first: with room for everything else, contents stay whole.
        let log_bytes: usize = f.tool_log.iter().map(|l| l.len() + 3).sum();
        let s = assemble(&f, Some(GOOD), 100, full.len() - log_bytes / 2);
        assert!(s.contains(f.files[9].content.as_deref().unwrap()));
        assert!(!s.contains(&f.tool_log[0]) && s.contains(&f.tool_log[39]));
        // Then contents, then errors: errors kept while contents suffice.
        let s = assemble(&f, Some(GOOD), 100, 12_000);
        assert!(s.contains(&f.errors[0]) && !s.contains(&f.tool_log[39]));
    }

    #[test]
    fn task_is_never_cut() {
        let f = Facts {
            task: Some("t".repeat(5000)),
            tool_log: vec!["a → ok".into()],
            ..Facts::default()
        };
        let s = assemble(&f, Some(GOOD), 3, 1000);
        assert!(s.contains(&"t".repeat(5000)));
    }

    #[test]
    fn fences_survive_backticks_in_content() {
        let f = Facts {
            files: vec![FileFact {
                path: "README.md".into(),
                action: "write".into(),
                content: Some("```sh\nls\n```\n## DECISIONS\n".into()),
            }],
            ..Facts::default()
        };
        let s = assemble(&f, Some(GOOD), 1, 100_000);
        assert!(
            s.contains("````\n```sh\nls\n```\n## DECISIONS\n````"),
            "{s}"
        );
        assert_eq!(validate(&s), Ok(()));
        let prev = previous_narrative(&s);
        assert!(prev.contains("## DECISIONS\n- max_age 3600: sessions last an hour"));
        assert!(!prev.contains("```sh"));
    }

    #[test]
    fn previous_narrative_round_trip() {
        let f = sample_facts();
        let s = assemble(&f, Some(GOOD), 12, 100_000);
        let prev = previous_narrative(&s);
        assert_eq!(validate(&prev), Ok(()));
        assert!(prev.starts_with("## PLAN STATE\n- fix cookie (in progress)"));
        assert!(prev.contains("## OPEN ITEMS / NEXT STEP\n- run tests"));
        assert!(
            !prev.contains(FACTS_LABEL)
                && !prev.contains("## TASK")
                && !prev.contains("TOOL CALL LOG")
        );
        assert_eq!(split_sections(&prev), split_sections(GOOD));
        // A fallback has no narrative to carry: the facts are handed over instead.
        let fb = assemble(&f, None, 12, 100_000);
        let prev_fb = previous_narrative(&fb);
        assert!(
            prev_fb.starts_with("Earlier conversation items")
                && prev_fb.contains("KeyError: 'session'")
        );
        assert_eq!(previous_narrative("free text summary"), "free text summary");
    }

    #[test]
    fn facts_serde_round_trip() {
        let f = sample_facts();
        let back: Facts = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back, f);
        let partial: Facts = serde_json::from_str(r#"{"task": "x"}"#).unwrap();
        assert_eq!(partial.task.as_deref(), Some("x"));
    }

    #[test]
    fn fake_upstream_answers_summarizer_requests() {
        use crate::fake_upstream::{auto_reply, Received, Reply};
        let items = [
            json!({"role": "user", "content": "add --verbose"}),
            fc("a", "sh", json!({"cmd": "ls"})),
        ];
        let transcript = render_transcript(&items, 100).join("\n");
        let request = |messages: Vec<Value>| Received {
            method: http::Method::POST,
            path: "/v1/chat/completions".into(),
            query: None,
            headers: Default::default(),
            body: json!({"model": "m", "messages": messages})
                .to_string()
                .into(),
        };
        let answer = |rec: &Received| match auto_reply(rec) {
            Reply::Full { body, .. } => serde_json::from_slice::<Value>(&body).unwrap(),
            other => panic!("{other:?}"),
        };
        let v = answer(&request(summarizer_messages(
            Some("## PLAN STATE\nold"),
            &transcript,
        )));
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(validate(text), Ok(()), "{text}");
        assert!(text.contains("add --verbose"));
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
        // Ordinary chat requests still get the ordinary answer.
        let plain = answer(&request(vec![json!({"role": "user", "content": "hi"})]));
        assert_eq!(
            plain["choices"][0]["message"]["content"],
            crate::fake_upstream::AUTO_TEXT
        );
    }
}
