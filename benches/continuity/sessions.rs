//! Scripted coding-agent sessions that plant one-off facts, the proxy run
//! that compacts them, and the model-free grade. Shared by the continuity
//! bench and the test that guards its target in CI.
//!
//! Each session is a Chat Completions history: a system prompt, the task,
//! then tool-call turns. The facts are planted early, so they fall in the
//! part that gets compacted: the task's exact wording, a file path and its
//! new content (each session uses a different edit form), a decision and its
//! reason and the next step (the agent's own words), a user constraint, and
//! an exact error string in the middle of a long failing log. Around them:
//! tens of kilobytes of file reads, test and build logs, then a few recent
//! turns that stay verbatim. The whole history goes to the proxy as one
//! request over the window, so it is compacted before it goes upstream; the
//! grade is whether each fact's exact text is still in what went upstream.

#![allow(dead_code)]

#[path = "trail.rs"]
pub mod trail;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use compactor::app::AppState;
use compactor::compaction::summary::SUMMARIZER_MARKER;
use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::{FakeUpstream, Received};
use compactor::server;
use serde_json::{json, Value};
use tokio::sync::oneshot;

/// Model name the sessions use; the runs give it their own window.
pub const MODEL: &str = "continuity-agent";
/// Upper bound for any single await of a run.
pub const STEP: Duration = Duration::from_secs(300);

/// What a planted fact is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Task,
    FilePath,
    FileContent,
    Decision,
    Constraint,
    Error,
    NextStep,
    /// A file created, edited, deleted, renamed or written by a one-liner.
    FileChanged,
    /// A command with its exit status (its ledger line).
    Command,
    /// One of the user's standing rules.
    Rule,
    /// A system message in the middle of the conversation.
    SystemMessage,
    /// A decision that reversed an earlier one.
    Reversal,
}

impl Kind {
    pub const ALL: [Kind; 12] = [
        Kind::Task,
        Kind::FilePath,
        Kind::FileContent,
        Kind::Decision,
        Kind::Constraint,
        Kind::Error,
        Kind::NextStep,
        Kind::FileChanged,
        Kind::Command,
        Kind::Rule,
        Kind::SystemMessage,
        Kind::Reversal,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Task => "task",
            Kind::FilePath => "file path",
            Kind::FileContent => "file content",
            Kind::Decision => "decision",
            Kind::Constraint => "constraint",
            Kind::Error => "error",
            Kind::NextStep => "next step",
            Kind::FileChanged => "file changed",
            Kind::Command => "command+exit",
            Kind::Rule => "rule",
            Kind::SystemMessage => "system msg",
            Kind::Reversal => "reversal",
        }
    }
}

/// One planted fact: retained when `needle` appears verbatim upstream.
#[derive(Debug, Clone)]
pub struct Fact {
    pub kind: Kind,
    pub needle: String,
}

/// A scripted session.
pub struct Session {
    pub name: &'static str,
    pub messages: Vec<Value>,
    pub facts: Vec<Fact>,
    /// The tool schemas the agent sends (none for the original six).
    pub tools: Vec<Value>,
}

// ---------------------------------------------------------------- filler

/// Deterministic word choice (a 64-bit LCG), so every run sends the same
/// bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

const WORDS: &[&str] = &[
    "retry", "backoff", "pool", "batch", "record", "cursor", "schema", "ledger", "window",
    "buffer", "parser", "row", "column", "writer", "reader", "frame", "offset", "segment",
];

/// A source file of about `bytes` bytes.
fn source(r: &mut Rng, module: &str, bytes: usize) -> String {
    let mut s = format!("//! The {module} module.\n\nuse std::collections::HashMap;\n\n");
    let mut n = 0;
    while s.len() < bytes {
        let (a, b) = (r.pick(WORDS), r.pick(WORDS));
        s.push_str(&format!(
            "/// Moves the {a} forward by one {b}.\npub fn {a}_{b}_{n}(state: &mut State, {b}: usize) -> Result<usize, Error> {{\n    let next = state.{a}.get({b}).copied().unwrap_or_default();\n    if next > state.limit {{\n        return Err(Error::Limit({b}));\n    }}\n    state.{a}.insert({b}, next + 1);\n    Ok(next)\n}}\n\n"
        ));
        n += 1;
    }
    s
}

/// A test log of about `bytes` bytes; `failure`, when given, is printed in
/// the middle (where a head-and-tail cut loses it) and the log ends failed.
fn test_log(r: &mut Rng, bytes: usize, failure: Option<&str>) -> String {
    let mut s = String::from("running 412 tests\n");
    let mut n = 0;
    let mut planted = failure.is_none();
    while s.len() < bytes {
        if !planted && s.len() > bytes / 2 {
            s.push_str(&format!("test exporter::iso::roundtrip_{n} ... FAILED\n\n---- exporter::iso::roundtrip_{n} stdout ----\n{}\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\n", failure.unwrap_or_default()));
            planted = true;
        }
        s.push_str(&format!(
            "test {}::{}_{n} ... ok\n",
            r.pick(WORDS),
            r.pick(WORDS)
        ));
        n += 1;
    }
    match failure {
        Some(_) => s.push_str("\ntest result: FAILED. 411 passed; 1 failed; 0 ignored\nProcess exited with code 101\n"),
        None => s.push_str("\ntest result: ok. 412 passed; 0 failed; 0 ignored\nProcess exited with code 0\n"),
    }
    s
}

/// A build log of about `bytes` bytes, successful.
fn build_log(r: &mut Rng, bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes {
        s.push_str(&format!(
            "   Compiling {}-{} v0.{}.{}\n",
            r.pick(WORDS),
            r.pick(WORDS),
            r.next() % 9,
            r.next() % 20
        ));
    }
    s.push_str("    Finished `dev` profile [unoptimized + debuginfo] target(s) in 41.07s\n");
    s
}

// ---------------------------------------------------------------- builder

struct Builder {
    messages: Vec<Value>,
    calls: usize,
    r: Rng,
}

impl Builder {
    fn new(seed: u64, task: &str) -> Builder {
        Builder {
            messages: vec![
                json!({"role": "system", "content": "You are a coding agent. Use the tools to read, edit and test the repository."}),
                json!({"role": "user", "content": task}),
            ],
            calls: 0,
            r: Rng(seed),
        }
    }

    /// An assistant turn (optional text) calling one tool, and its output.
    fn call(&mut self, text: Option<&str>, name: &str, args: Value, output: &str) {
        self.calls += 1;
        let id = format!("call_{}", self.calls);
        self.messages.push(json!({
            "role": "assistant",
            "content": text,
            "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}],
        }));
        self.messages
            .push(json!({"role": "tool", "tool_call_id": id, "content": output}));
    }

    fn user(&mut self, text: &str) {
        self.messages.push(json!({"role": "user", "content": text}));
    }

    fn assistant(&mut self, text: &str) {
        self.messages
            .push(json!({"role": "assistant", "content": text}));
    }

    /// `n` filler turns: file reads, builds and passing test runs.
    fn filler(&mut self, n: usize, bytes: usize) {
        for i in 0..n {
            let module = format!("src/{}_{}.rs", self.r.pick(WORDS), self.calls);
            let out = match i % 3 {
                0 => source(&mut self.r, &module, bytes),
                1 => build_log(&mut self.r, bytes / 2),
                _ => test_log(&mut self.r, bytes, None),
            };
            let (name, args) = match i % 3 {
                0 => ("read_file", json!({"path": module})),
                1 => ("shell", json!({"command": "cargo build --workspace"})),
                _ => ("shell", json!({"command": "cargo test --workspace"})),
            };
            self.call(None, name, args, &out);
        }
    }
}

/// The edit forms, one per session.
#[derive(Debug, Clone, Copy)]
enum Form {
    ApplyPatch,
    UnifiedDiff,
    ClaudeEdit,
    StrReplaceEditor,
    HeredocSed,
    Aider,
}

const FORMS: [Form; 6] = [
    Form::ApplyPatch,
    Form::UnifiedDiff,
    Form::ClaudeEdit,
    Form::StrReplaceEditor,
    Form::HeredocSed,
    Form::Aider,
];

/// The planted file before its edit.
const SETTINGS: &str = "pub struct Settings {\n    pub name: String,\n    pub zone: Zone,\n}\n";

/// Plants the file fact with `form`: `path` ends up containing `line`.
fn plant_edit(b: &mut Builder, form: Form, path: &str, line: &str) {
    let ok = "Process exited with code 0\nOutput:\n";
    match form {
        Form::ApplyPatch => {
            let patch = format!("*** Begin Patch\n*** Update File: {path}\n@@ pub struct Settings {{\n-    pub zone: Zone,\n+{line}\n*** End Patch\n");
            b.call(
                None,
                "apply_patch",
                json!({"input": patch}),
                &format!("Success. Updated the following files:\nM {path}\n"),
            );
        }
        Form::UnifiedDiff => {
            let diff = format!("diff --git a/{path} b/{path}\nindex 3b18e51..a9c2f0d 100644\n--- a/{path}\n+++ b/{path}\n@@ -10,7 +10,7 @@ pub struct Settings {{\n     pub name: String,\n-    pub zone: Zone,\n+{line}\n     pub retries: u32,\n }}\n");
            b.call(
                None,
                "apply_patch",
                json!({"patch": diff}),
                "Applied patch cleanly.",
            );
        }
        Form::ClaudeEdit => {
            b.call(
                None,
                "Write",
                json!({"file_path": path, "content": SETTINGS}),
                "File created successfully",
            );
            b.call(
                None,
                "Edit",
                json!({"file_path": path, "old_string": "    pub zone: Zone,", "new_string": line}),
                "The file has been updated.",
            );
        }
        Form::StrReplaceEditor => {
            b.call(
                None,
                "str_replace_editor",
                json!({"command": "create", "path": path, "file_text": SETTINGS}),
                "File created successfully.",
            );
            b.call(None, "str_replace_editor", json!({"command": "str_replace", "path": path, "old_str": "    pub zone: Zone,", "new_str": line}), "The file has been edited.");
        }
        Form::HeredocSed => {
            let cmd = format!("cat > {path} <<'EOF'\n{SETTINGS}EOF");
            b.call(None, "shell", json!({"command": cmd}), ok);
            let sed = format!("sed -i 's|    pub zone: Zone,|{line}|' {path}");
            b.call(None, "shell", json!({"command": sed}), ok);
        }
        Form::Aider => {
            b.assistant(&format!("{path}\n```rust\n<<<<<<< SEARCH\n    pub zone: Zone,\n=======\n{line}\n>>>>>>> REPLACE\n```\n"));
        }
    }
}

/// The six scripted sessions (one per edit form). `scale` multiplies the
/// filler volume (1.0 = the bench; smaller for the CI test).
pub fn sessions(scale: f64) -> Vec<Session> {
    let topics = [
        ("ledger", "Q7"),
        ("exporter", "K2"),
        ("billing", "M5"),
        ("ingest", "T9"),
        ("scheduler", "R4"),
        ("reports", "W3"),
    ];
    let filler_bytes = ((24_000.0 * scale) as usize).max(2_000);
    // Fewer filler turns too when scaled down (at least one of each).
    let turns = |n: usize| ((n as f64 * scale).round() as usize).max(1);
    FORMS
        .iter()
        .zip(topics)
        .enumerate()
        .map(|(i, (&form, (topic, tag)))| {
            let task = format!("Make the {topic} export write every timestamp as UTC RFC 3339 (ticket {tag}-{i}41), without changing the public CSV columns.");
            let path = format!("crates/{topic}/src/settings_{tag}.rs");
            let line = format!("    pub zone_{tag}: UtcOnly, // {topic} stays in UTC");
            let reason = format!("the {topic} downstream parser rejects numeric offsets like +02:00");
            let decision = format!("Decision: convert with chrono::Utc at the writer because {reason}.");
            let constraint = format!("Constraint from me: never rename the {topic}_legacy table, other jobs read it.");
            let error = format!("thread 'exporter::iso::{topic}' panicked at crates/{topic}/src/csv.rs:88:14: expected `2024-03-01T00:00:00Z`, got `2024-03-01T01:00:00+01:00` ({tag})");
            let next = format!("Next step: regenerate tests/fixtures/{topic}_{tag}.csv and rerun the iso roundtrip suite.");
            let mut b = Builder::new(0x5EED ^ i as u64, &task);
            b.filler(turns(2), filler_bytes);
            b.call(Some(&decision), "read_file", json!({"path": path}), &source(&mut Rng(i as u64), &path, filler_bytes / 3));
            plant_edit(&mut b, form, &path, &line);
            b.filler(turns(2), filler_bytes);
            b.user(&constraint);
            b.call(None, "shell", json!({"command": format!("cargo test -p {topic}")}), &test_log(&mut Rng(7 + i as u64), filler_bytes, Some(&error)));
            b.call(Some(&next), "shell", json!({"command": "git status --short"}), &format!(" M {path}\n"));
            b.filler(turns(5), filler_bytes);
            // Recent turns, kept verbatim.
            b.user("Keep going.");
            b.filler(1, filler_bytes / 4);
            Session {
                name: form_name(form),
                messages: b.messages,
                facts: vec![
                    Fact { kind: Kind::Task, needle: task },
                    Fact { kind: Kind::FilePath, needle: path },
                    Fact { kind: Kind::FileContent, needle: line.trim().to_string() },
                    Fact { kind: Kind::Decision, needle: reason },
                    Fact { kind: Kind::Constraint, needle: format!("never rename the {topic}_legacy table") },
                    Fact { kind: Kind::Error, needle: error },
                    Fact { kind: Kind::NextStep, needle: format!("regenerate tests/fixtures/{topic}_{tag}.csv") },
                ],
                tools: Vec::new(),
            }
        })
        .collect()
}

fn form_name(f: Form) -> &'static str {
    match f {
        Form::ApplyPatch => "apply_patch",
        Form::UnifiedDiff => "unified diff",
        Form::ClaudeEdit => "Write/Edit",
        Form::StrReplaceEditor => "str_replace_editor",
        Form::HeredocSed => "heredoc + sed -i",
        Form::Aider => "aider SEARCH/REPLACE",
    }
}

// ---------------------------------------------------------------- other agents

/// The tool vocabularies of other agents, each session failing with an
/// output from the failure corpus.
#[derive(Debug, Clone, Copy)]
enum Agent {
    ClaudeCode,
    Opencode,
    Codex,
    Aider,
    SingleBash,
}

const AGENTS: [Agent; 5] = [
    Agent::ClaudeCode,
    Agent::Opencode,
    Agent::Codex,
    Agent::Aider,
    Agent::SingleBash,
];

/// An entry of `tests/corpus/failures/failing/`: the command, its output and
/// the strings that must be kept.
pub struct CorpusFailure {
    pub command: String,
    pub output: String,
    pub exit_code: i64,
    pub keep: Vec<String>,
}

pub fn corpus_failure(name: &str) -> CorpusFailure {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus/failures/failing")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("corpus entry");
    CorpusFailure {
        command: v["command"].as_str().unwrap_or("").to_string(),
        output: v["output"].as_str().unwrap_or("").to_string(),
        exit_code: v["exit_code"].as_i64().unwrap_or(1),
        keep: v["keep"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|k| k.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// The failures the agent sessions plant, two per agent.
const AGENT_FAILURES: [[&str; 2]; 5] = [
    ["go-test-verbose", "terraform-unsupported"],
    ["vitest-typeerror", "cargo-test-assert"],
    ["buildkit-require-hashes", "java-exception"],
    ["pytest-assert", "tsc-plain"],
    ["psql-relation", "go-test"],
];

fn schema(name: &str, props: &[&str]) -> Value {
    let properties: serde_json::Map<String, Value> = props
        .iter()
        .map(|p| (p.to_string(), json!({"type": "string"})))
        .collect();
    json!({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties, "required": props}}})
}

impl Agent {
    fn name(self, n: usize) -> &'static str {
        match (self, n) {
            (Agent::ClaudeCode, 0) => "Claude Code 1",
            (Agent::ClaudeCode, _) => "Claude Code 2",
            (Agent::Opencode, 0) => "opencode 1",
            (Agent::Opencode, _) => "opencode 2",
            (Agent::Codex, 0) => "Codex 1",
            (Agent::Codex, _) => "Codex 2",
            (Agent::Aider, 0) => "aider 1",
            (Agent::Aider, _) => "aider 2",
            (Agent::SingleBash, 0) => "one bash tool 1",
            (Agent::SingleBash, _) => "one bash tool 2",
        }
    }

    /// The tools the agent declares: a few, with small schemas (with the
    /// system prompt, under 300 tokens).
    fn tools(self) -> Vec<Value> {
        match self {
            Agent::ClaudeCode => vec![
                schema("Bash", &["command", "description"]),
                schema("Read", &["file_path"]),
                schema("Write", &["file_path", "content"]),
                schema("Edit", &["file_path", "old_string", "new_string"]),
            ],
            Agent::Opencode => vec![
                schema("bash", &["command", "description"]),
                schema("read", &["filePath"]),
                schema("write", &["filePath", "content"]),
                schema("edit", &["filePath", "oldString", "newString"]),
            ],
            Agent::Codex => vec![schema("shell", &["command"])],
            Agent::Aider => Vec::new(),
            Agent::SingleBash => vec![schema("bash", &["command"])],
        }
    }

    fn system(self) -> &'static str {
        match self {
            Agent::ClaudeCode => {
                "You are Claude Code, a CLI coding assistant. Use the tools to help the user."
            }
            Agent::Opencode => "You are opencode, an interactive CLI coding agent.",
            Agent::Codex => "You are Codex, a coding agent running in a terminal.",
            Agent::Aider => {
                "Act as an expert software developer. Always use SEARCH/REPLACE blocks for edits."
            }
            Agent::SingleBash => {
                "You are a coding agent with one tool: bash. Edit files with heredocs."
            }
        }
    }
}

/// Builds agent turns in one agent's vocabulary.
struct AgentBuilder {
    agent: Agent,
    b: Builder,
}

impl AgentBuilder {
    /// A shell command and its output (exit code as the agent reports it).
    fn shell(&mut self, text: Option<&str>, cmd: &str, output: &str, exit: i64) {
        match self.agent {
            Agent::ClaudeCode => self.b.call(
                text,
                "Bash",
                json!({"command": cmd, "description": "Run the command"}),
                output,
            ),
            Agent::Opencode => self.b.call(
                text,
                "bash",
                json!({"command": cmd, "description": "Runs the command"}),
                output,
            ),
            Agent::Codex => self.b.call(
                text,
                "shell",
                json!({"command": ["bash", "-lc", cmd]}),
                &json!({"output": output, "metadata": {"exit_code": exit, "duration_seconds": 2.1}})
                    .to_string(),
            ),
            Agent::Aider => {
                if let Some(t) = text {
                    self.b.assistant(t);
                }
                self.b.user(&format!(
                    "I ran this command:\n\n{cmd}\n\nAnd got this output:\n\n{output}\n"
                ));
                self.b.assistant("Ok.");
            }
            Agent::SingleBash => self.b.call(text, "bash", json!({"command": cmd}), output),
        }
    }

    fn read(&mut self, text: Option<&str>, path: &str, content: &str) {
        match self.agent {
            Agent::ClaudeCode => {
                let numbered: String = content
                    .lines()
                    .enumerate()
                    .map(|(i, l)| format!("{:>6}\t{l}\n", i + 1))
                    .collect();
                self.b
                    .call(text, "Read", json!({"file_path": path}), &numbered)
            }
            Agent::Opencode => self.b.call(
                text,
                "read",
                json!({"filePath": path}),
                &format!("<file>\n{content}</file>"),
            ),
            Agent::Aider => {
                if let Some(t) = text {
                    self.b.assistant(t);
                }
                self.b.user(&format!("{path}\n```\n{content}```\n"));
                self.b.assistant("Ok, I have the file.");
            }
            _ => self.shell(text, &format!("cat {path}"), content, 0),
        }
    }

    /// Plants the file fact: `path` ends up containing `line`.
    fn edit(&mut self, path: &str, line: &str) {
        let old = "    pub zone: Zone,";
        match self.agent {
            Agent::ClaudeCode => {
                self.b.call(
                    None,
                    "Write",
                    json!({"file_path": path, "content": SETTINGS}),
                    &format!("File created successfully at: {path}"),
                );
                self.b.call(
                    None,
                    "Edit",
                    json!({"file_path": path, "old_string": old, "new_string": line}),
                    &format!("The file {path} has been updated. Here's the result of running `cat -n` on a snippet of the edited file:"),
                );
            }
            Agent::Opencode => {
                self.b.call(
                    None,
                    "write",
                    json!({"filePath": path, "content": SETTINGS}),
                    "",
                );
                self.b.call(
                    None,
                    "edit",
                    json!({"filePath": path, "oldString": old, "newString": line}),
                    "",
                );
            }
            Agent::Codex => {
                let patch = format!("*** Begin Patch\n*** Update File: {path}\n@@ pub struct Settings {{\n-{old}\n+{line}\n*** End Patch\n");
                self.b.call(
                    None,
                    "shell",
                    json!({"command": ["apply_patch", patch]}),
                    &json!({"output": format!("Success. Updated the following files:\nM {path}\n"), "metadata": {"exit_code": 0, "duration_seconds": 0.0}}).to_string(),
                );
            }
            Agent::Aider => {
                self.b.assistant(&format!("{path}\n```rust\n<<<<<<< SEARCH\n{old}\n=======\n{line}\n>>>>>>> REPLACE\n```\n"));
            }
            Agent::SingleBash => {
                let content = SETTINGS.replace(old, line);
                self.b.call(
                    None,
                    "bash",
                    json!({"command": format!("mkdir -p $(dirname {path}) && cat > {path} <<'EOF'\n{content}EOF")}),
                    "",
                );
            }
        }
    }

    /// `n` filler turns: reads, builds and passing test runs.
    fn filler(&mut self, n: usize, bytes: usize) {
        filler_turns(self, n, bytes);
    }
}

impl Turns for AgentBuilder {
    fn builder(&mut self) -> &mut Builder {
        &mut self.b
    }
    fn read_file(&mut self, path: &str, content: &str) {
        self.read(None, path, content);
    }
    fn run_shell(&mut self, cmd: &str, output: &str) {
        self.shell(None, cmd, output, 0);
    }
}

/// A builder of turns in one agent's vocabulary, for [`filler_turns`].
trait Turns {
    fn builder(&mut self) -> &mut Builder;
    /// A file read, as the agent reads one.
    fn read_file(&mut self, path: &str, content: &str);
    /// A successful shell command and its output.
    fn run_shell(&mut self, cmd: &str, output: &str);
}

/// `n` filler turns of `t`: reads, builds and passing test runs.
fn filler_turns(t: &mut impl Turns, n: usize, bytes: usize) {
    for i in 0..n {
        let b = t.builder();
        let module = format!("src/{}_{}.rs", b.r.pick(WORDS), b.calls);
        match i % 3 {
            0 => {
                let src = source(&mut t.builder().r, &module, bytes);
                t.read_file(&module, &src);
            }
            1 => {
                let log = build_log(&mut t.builder().r, bytes / 2);
                t.run_shell("cargo build --workspace", &log);
            }
            _ => {
                let log = test_log(&mut t.builder().r, bytes, None);
                t.run_shell("cargo test --workspace", &log);
            }
        }
    }
}

/// A corpus failure inside a longer log: progress lines before and after
/// (so a head-and-tail cut loses it).
fn buried(r: &mut Rng, output: &str, bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes / 2 {
        s.push_str(&format!(
            "[step {}] {} {} done\n",
            r.next() % 900,
            r.pick(WORDS),
            r.pick(WORDS)
        ));
    }
    s.push_str(output);
    if !output.ends_with('\n') {
        s.push('\n');
    }
    let end = s.len() + bytes / 2;
    while s.len() < end {
        s.push_str(&format!(
            "[cleanup {}] removed {} cache\n",
            r.next() % 900,
            r.pick(WORDS)
        ));
    }
    s
}

/// Ten sessions in five agents' vocabularies (two each), each planting the
/// same kinds of facts as [`sessions`], its error an output of the failure
/// corpus (every string that entry must keep is a planted fact).
pub fn agent_sessions(scale: f64) -> Vec<Session> {
    let topics = [
        ("payouts", "P1"),
        ("invoices", "N8"),
        ("audit", "A6"),
        ("catalog", "C2"),
        ("search", "S5"),
        ("metrics", "E4"),
        ("accounts", "U7"),
        ("refunds", "F3"),
        ("shipping", "H9"),
        ("alerts", "L2"),
    ];
    let filler_bytes = ((24_000.0 * scale) as usize).max(2_000);
    let turns = |n: usize| ((n as f64 * scale).round() as usize).max(1);
    let mut out = Vec::new();
    for (a, (&agent, failures)) in AGENTS.iter().zip(AGENT_FAILURES).enumerate() {
        for (n, entry) in failures.into_iter().enumerate() {
            let k = a * 2 + n;
            let (topic, tag) = topics[k];
            let failure = corpus_failure(entry);
            let task = format!("Make the {topic} service store every amount as integer cents (ticket {tag}-{k}07), keeping the REST API unchanged.");
            let path = format!("services/{topic}/src/settings_{tag}.rs");
            let line = format!("    pub zone_{tag}: CentsOnly, // {topic} keeps cents");
            let reason = format!("the {topic} ledger export truncates floats past two decimals");
            let decision = if n == 0 {
                format!("I chose integer cents over decimals because {reason}.")
            } else {
                format!("Going with integer cents because {reason}.")
            };
            let constraint = if n == 0 {
                format!("Please don't touch the {topic}_archive schema, the nightly job reads it.")
            } else {
                format!("Never touch the {topic}_archive schema: the nightly job reads it.")
            };
            let next_needle =
                format!("backfill the {topic}_{tag} amounts with scripts/backfill_cents.py");
            let next = if n == 0 {
                format!("Next, I'll {next_needle} and rerun the suite.")
            } else {
                format!("Next step: {next_needle}, then rerun the suite.")
            };
            let mut b = AgentBuilder {
                agent,
                b: Builder::new(0xA6E ^ k as u64, &task),
            };
            b.b.messages[0] = json!({"role": "system", "content": agent.system()});
            b.filler(turns(2), filler_bytes);
            let src = source(&mut Rng(k as u64), &path, filler_bytes / 3);
            b.read(Some(&decision), &path, &src);
            b.edit(&path, &line);
            b.filler(turns(2), filler_bytes);
            b.b.user(&constraint);
            let log = buried(&mut Rng(11 + k as u64), &failure.output, filler_bytes);
            b.shell(None, &failure.command, &log, failure.exit_code);
            b.shell(
                Some(&next),
                "git status --short",
                &format!(" M {path}\n"),
                0,
            );
            b.filler(turns(5), filler_bytes);
            b.b.user("Keep going.");
            match agent {
                // aider's reads are user messages, and the newest user
                // message always stays whole: its last turn is a reply.
                Agent::Aider => b.b.assistant("Now the remaining callers of the settings."),
                _ => b.filler(1, filler_bytes / 4),
            }
            let mut facts = vec![
                Fact {
                    kind: Kind::Task,
                    needle: task,
                },
                Fact {
                    kind: Kind::FilePath,
                    needle: path,
                },
                Fact {
                    kind: Kind::FileContent,
                    needle: line.trim().to_string(),
                },
                Fact {
                    kind: Kind::Decision,
                    needle: reason,
                },
                Fact {
                    kind: Kind::Constraint,
                    needle: format!("touch the {topic}_archive schema"),
                },
            ];
            facts.extend(failure.keep.iter().map(|k| Fact {
                kind: Kind::Error,
                needle: k.clone(),
            }));
            facts.push(Fact {
                kind: Kind::NextStep,
                needle: next_needle,
            });
            out.push(Session {
                name: agent.name(n),
                messages: b.b.messages,
                facts,
                tools: agent.tools(),
            });
        }
    }
    out
}

// ---------------------------------------------------------------- cost

/// Time the pure work a compaction does on every session's history: the
/// facts (every tool output read for failures), the prune stubs and the
/// truncation markers (each with its digest). Returns (sessions, bytes of
/// history, time per pass over all of them).
pub fn extraction_cost(passes: u32) -> (usize, usize, std::time::Duration) {
    use compactor::compaction::ladder::{prune_outputs, truncate_outputs, TruncateLimits};
    let all: Vec<Session> = sessions(1.0)
        .into_iter()
        .chain(agent_sessions(1.0))
        .collect();
    let bytes = all
        .iter()
        .map(|s| {
            s.messages
                .iter()
                .map(|m| m.to_string().len())
                .sum::<usize>()
        })
        .sum();
    let hashes: Vec<Vec<_>> = all
        .iter()
        .map(|s| s.messages.iter().map(compactor::wire::item_hash).collect())
        .collect();
    let limits = TruncateLimits {
        max_bytes: 8192,
        keep_head: 2730,
        keep_tail: 1365,
    };
    let t = std::time::Instant::now();
    let mut sink = 0;
    for _ in 0..passes {
        for (s, h) in all.iter().zip(&hashes) {
            let facts = compactor::compaction::summary::extract_facts(&s.messages, None);
            sink += facts.errors.len();
            sink += prune_outputs(&s.messages, h).1;
            sink += truncate_outputs(&s.messages, h, limits).1;
        }
    }
    let per = t.elapsed() / passes.max(1);
    assert!(sink > 0);
    (all.len(), bytes, per)
}

/// What the sections before the narrative (RULES & SYSTEM MESSAGES and
/// LEDGER) cost in the facts-only summary of a session's whole history:
/// (family, sessions, their bytes, the summaries' bytes), at full size and
/// within `budget` bytes.
pub fn ledger_cost(budget: usize) -> Vec<(&'static str, usize, usize, usize)> {
    use compactor::compaction::summary::{assemble, extract_facts};
    let families: [(&'static str, Vec<Session>); 3] = [
        ("edit forms", sessions(1.0)),
        ("other agents", agent_sessions(1.0)),
        ("the trail", trail::trail_sessions(1.0)),
    ];
    families
        .into_iter()
        .map(|(name, list)| {
            let (mut ledger, mut whole) = (0, 0);
            for s in &list {
                let facts = extract_facts(&s.messages[1..], None);
                let text = assemble(&facts, None, s.messages.len() - 1, budget);
                let start = ["\n\n## RULES & SYSTEM MESSAGES\n", "\n\n## LEDGER\n"]
                    .iter()
                    .filter_map(|h| text.find(h))
                    .min();
                let end = text.find("\n\n## PLAN STATE\n");
                if let (Some(a), Some(b)) = (start, end) {
                    ledger += b - a;
                }
                whole += text.len();
            }
            (name, list.len(), ledger, whole)
        })
        .collect()
}

/// Prints [`ledger_cost`] at full size and within `budgets`.
pub fn print_ledger_cost(budgets: &[usize]) {
    println!(
        "\nthe ledger's cost: bytes of RULES & SYSTEM MESSAGES + LEDGER in the facts-only summary"
    );
    for &budget in budgets {
        for (name, n, ledger, whole) in ledger_cost(budget) {
            let at = if budget == usize::MAX {
                "full size".to_string()
            } else {
                format!("within {budget} bytes")
            };
            println!(
                "  {name} ({n} sessions), {at}: {} of {} bytes per summary ({:.0}%)",
                ledger / n.max(1),
                whole / n.max(1),
                100.0 * ledger as f64 / whole.max(1) as f64
            );
        }
    }
}

// ---------------------------------------------------------------- summarizers

/// A summarizer that writes nothing useful, in the styles small models
/// answer with: one-line labels echoing the prompt's descriptions, or prose.
pub fn useless_summary(variant: usize) -> String {
    if variant.is_multiple_of(2) {
        "PLAN STATE: the current plan or todo list, each step with its status.\nDECISIONS: choices made and why, one line each.\nFILE/WORKSPACE STATE: every file created, changed or deleted.\nCONSTRAINTS & PREFERENCES: rules and preferences the user stated.\nERRORS & FIXES: errors hit, quoted exactly.\nOPEN ITEMS / NEXT STEP: what remains to be done.\n".to_string()
    } else {
        "Sure! The assistant and the user worked on the code together and made good progress. Let me know if you need anything else.".to_string()
    }
}

pub fn is_summary_call(r: &Received) -> bool {
    let v = r.json();
    v["messages"].as_array().is_some_and(|m| {
        m.iter().any(|m| {
            m["role"] == "system"
                && m["content"]
                    .as_str()
                    .is_some_and(|s| s.contains(SUMMARIZER_MARKER))
        })
    })
}

// ---------------------------------------------------------------- runs

/// Rung 1 disabled: no tool output is ever this long.
const NEVER_TRUNCATE: usize = usize::MAX / 2;
/// The summary rung's ordinary window, tokens.
pub const SUMMARY_WINDOW: u64 = 4_096;
/// The tight window, tokens (also the real llama-server's own).
pub const TIGHT_WINDOW: u64 = 2_048;
/// The tightest window the facts must survive, tokens, and its answer's
/// reservation.
pub const TIGHTEST_WINDOW: u64 = 1_600;
/// Tokens reserved for the answer at [`TIGHTEST_WINDOW`].
pub const TIGHTEST_OUTPUT: u64 = 200;

/// A run at `window` with an eighth of it reserved for the answer.
pub fn at(window: u64, tool_output_max_bytes: usize) -> RunConfig {
    RunConfig {
        window,
        max_output: window / 8,
        tool_output_max_bytes,
        target_ratio: None,
    }
}

/// The target of the run that makes rung 1 (truncate) run: one a
/// truncation of the session's long outputs reaches (the default target is
/// deeper, which a summary reaches and a truncation does not).
pub const TRUNCATE_TARGET_RATIO: f64 = 0.4;

/// Runs every session at every rung against `fake` answering summaries with
/// nothing useful.
pub async fn fake_tier(scale: f64) -> Table {
    fake_tier_of(&sessions(scale)).await
}

/// [`fake_tier`] over the trail sessions ([`trail::trail_sessions`]).
pub async fn trail_fake_tier(scale: f64) -> Table {
    fake_tier_of(&trail::trail_sessions(scale)).await
}

/// [`fake_tier`] over the sessions in other agents' vocabularies.
pub async fn agents_fake_tier(scale: f64) -> Table {
    fake_tier_of(&agent_sessions(scale)).await
}

/// Runs `list` at every rung against a fake upstream answering summaries
/// with nothing useful.
pub async fn fake_tier_of(list: &[Session]) -> Table {
    let mut table = Table::new();
    for (i, s) in list.iter().enumerate() {
        let fake = tokio::time::timeout(STEP, FakeUpstream::start())
            .await
            .expect("fake upstream timed out")
            .expect("fake upstream");
        fake.set_summary_reply(Some(useless_summary(i)));
        let tokens = session_tokens(s);
        let runs = [
            (
                "",
                RunConfig {
                    target_ratio: Some(TRUNCATE_TARGET_RATIO),
                    ..at(tokens, 8192)
                },
            ),
            ("", at(tokens, NEVER_TRUNCATE)),
            ("", at(SUMMARY_WINDOW, 8192)),
            (" tight", at(TIGHT_WINDOW, 8192)),
            (
                " 1600",
                RunConfig {
                    window: TIGHTEST_WINDOW,
                    max_output: TIGHTEST_OUTPUT,
                    tool_output_max_bytes: 8192,
                    target_ratio: None,
                },
            ),
        ];
        for (suffix, cfg) in runs {
            let mut g = run(s, fake.url(), &fake, cfg).await;
            if std::env::var_os("CONT_VERBOSE").is_some() {
                eprintln!("  {} at window {}: {:?}", s.name, cfg.window, g.rung);
            }
            g.rung = g.rung.map(|r| format!("{r}{suffix}"));
            report_misses(s.name, &g, &s.facts);
            add(&mut table, &g);
        }
    }
    table
}

/// The windows, tokens, the trail is swept over: down to 4,000.
pub const TRAIL_WINDOWS: [u64; 4] = [32_000, 16_000, 8_000, 4_000];

/// Runs `list` at each of `windows` (200 tokens for the answer), the rung
/// named by its window: where each kind stops surviving.
pub async fn window_sweep(list: &[Session], windows: &[u64]) -> Table {
    let mut table = Table::new();
    for (i, s) in list.iter().enumerate() {
        let fake = tokio::time::timeout(STEP, FakeUpstream::start())
            .await
            .expect("fake upstream timed out")
            .expect("fake upstream");
        fake.set_summary_reply(Some(useless_summary(i)));
        for &window in windows {
            let cfg = RunConfig {
                window,
                max_output: TIGHTEST_OUTPUT,
                tool_output_max_bytes: 8192,
                target_ratio: None,
            };
            let mut g = run(s, fake.url(), &fake, cfg).await;
            g.rung = Some(match g.rung {
                Some(_) => format!("{window:>5}"),
                None => format!("{window:>5} failed"),
            });
            add(&mut table, &g);
        }
    }
    table
}

pub fn report_misses(name: &str, g: &Graded, facts: &[Fact]) {
    if std::env::var_os("CONT_VERBOSE").is_none() {
        return;
    }
    for ((kind, kept), f) in g.kept.iter().zip(facts) {
        if !kept {
            eprintln!(
                "  miss [{name}, {:?}] {}: {}",
                g.rung,
                kind.name(),
                f.needle
            );
        }
    }
}

/// How a run's proxy is set up.
#[derive(Debug, Clone, Copy)]
pub struct RunConfig {
    pub window: u64,
    /// Tokens reserved for the answer (`max_output_tokens`).
    pub max_output: u64,
    /// Rung 1's threshold; huge = rung 1 never applies.
    pub tool_output_max_bytes: usize,
    /// `compaction.target_ratio`, when not the default.
    pub target_ratio: Option<f64>,
}

/// What one run gave.
#[derive(Debug)]
pub struct Graded {
    /// The rung the proxy used, `None` when nothing was compacted.
    pub rung: Option<String>,
    /// Per planted fact, whether it reached upstream.
    pub kept: Vec<(Kind, bool)>,
    pub summary_calls: usize,
}

/// Sends `session` through a fresh proxy whose upstream is `upstream` (the
/// fake, or a router in front of it) and grades what reached `fake`.
pub async fn run(
    session: &Session,
    upstream: String,
    fake: &FakeUpstream,
    cfg: RunConfig,
) -> Graded {
    run_sent(session, upstream, fake, cfg).await.0
}

/// [`run`], and the body of the request that went upstream (the compacted
/// conversation; empty when none arrived).
pub async fn run_sent(
    session: &Session,
    upstream: String,
    fake: &FakeUpstream,
    cfg: RunConfig,
) -> (Graded, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("compactor.db");
    let mut config = Config::default();
    config.upstream.base_url = upstream;
    config.store.path = db.display().to_string();
    config.server.shutdown_grace_secs = 2;
    config.compaction.background = false;
    config.compaction.tool_output_max_bytes = cfg.tool_output_max_bytes;
    if let Some(r) = cfg.target_ratio {
        config.compaction.target_ratio = r;
    }
    config.models.insert(
        0,
        ModelConfig {
            pattern: MODEL.into(),
            context_window: cfg.window,
            max_output_tokens: Some(cfg.max_output),
            trigger_ratio: None,
            ..Default::default()
        },
    );
    let proxy = Proxy::start(config).await;
    let addr = proxy.addr;
    let before = fake.received().len();
    let client = reqwest::Client::new();
    let mut body = json!({"model": MODEL, "messages": session.messages});
    if !session.tools.is_empty() {
        body["tools"] = Value::Array(session.tools.clone());
    }
    let resp = tokio::time::timeout(
        STEP,
        client
            .post(format!("http://{addr}/v1/chat/completions"))
            .header("authorization", "Bearer sk-continuity")
            .json(&body)
            .send(),
    )
    .await
    .expect("request timed out")
    .expect("request");
    let compaction = resp
        .headers()
        .get("x-compactor-compacted")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let _ = tokio::time::timeout(STEP, resp.bytes()).await;
    proxy.stop().await;
    let received: Vec<Received> = fake.received()[before..].to_vec();
    let summary_calls = received.iter().filter(|r| is_summary_call(r)).count();
    let upstream_text = received
        .iter()
        .rev()
        .find(|r| !is_summary_call(r))
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .unwrap_or_default();
    // The body is JSON: compare against the needles JSON-escaped the same way.
    // A command and its status must be on one line of the decoded text.
    let decoded = serde_json::from_str::<Value>(&upstream_text)
        .map(|v| compactor::compaction::summary::sent_text(std::iter::once(&v)))
        .unwrap_or_default();
    let kept = session
        .facts
        .iter()
        .map(|f| {
            let escaped = serde_json::to_string(&f.needle).unwrap_or_default();
            let inner = &escaped[1..escaped.len() - 1];
            let kept = match (f.kind, f.needle.split_once(" → ")) {
                (Kind::Command, Some((cmd, status))) => decoded
                    .lines()
                    .any(|l| l.contains(cmd) && l.contains(status)),
                _ => upstream_text.contains(inner),
            };
            (f.kind, kept)
        })
        .collect();
    if std::env::var_os("CONT_DUMP").is_some() {
        eprintln!(
            "--- {} (window {}) sent upstream:\n{upstream_text}",
            session.name, cfg.window
        );
    }
    let rung = compaction.and_then(|id| {
        report_audit(&db, &id, session.name, cfg.window);
        rung_of(&db, &id)
    });
    (
        Graded {
            rung,
            kept,
            summary_calls,
        },
        upstream_text,
    )
}

/// A proxy serving `config` on a loopback port, in this process.
pub struct Proxy {
    pub addr: SocketAddr,
    stop: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(config: Config) -> Proxy {
        let state = AppState::open(config).expect("open state");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let (stop, rx) = oneshot::channel::<()>();
        let server = tokio::spawn(server::run(listener, state, async {
            let _ = rx.await;
        }));
        Proxy { addr, stop, server }
    }

    /// Shuts it down (its drain bounded by [`STEP`]).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(STEP, self.server).await;
    }
}

/// The text of a message's content: a string, or its text parts joined.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A request a [`start_router`] passed on, and its answer.
pub struct Routed<'a> {
    /// It carries the summarizer's marker.
    pub summary: bool,
    pub body: &'a [u8],
    pub status: u16,
    pub answer: &'a [u8],
    pub elapsed: Duration,
}

/// A front for the proxy's upstream: each request goes on to the base URL
/// `pick` gives for it (by whether it is a summary call), and `seen` is
/// told of it and its answer. Its base URL, with `/v1`.
pub async fn start_router(
    pick: impl Fn(bool) -> String + Send + Sync + 'static,
    seen: impl Fn(Routed) + Send + Sync + 'static,
) -> String {
    use http_body_util::{BodyExt, Full};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let client = reqwest::Client::new();
    let route = std::sync::Arc::new((pick, seen));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (client, route) = (client.clone(), route.clone());
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (client, route) = (client.clone(), route.clone());
                    async move {
                        let path = req.uri().path().trim_start_matches("/v1").to_string();
                        let method = req.method().clone();
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|c| c.to_bytes())
                            .unwrap_or_default();
                        let summary = String::from_utf8_lossy(&body).contains(SUMMARIZER_MARKER);
                        let started = std::time::Instant::now();
                        let (status, answer) = match client
                            .request(method, format!("{}{path}", (route.0)(summary)))
                            .header("content-type", "application/json")
                            .body(body.clone())
                            .timeout(STEP)
                            .send()
                            .await
                        {
                            Ok(r) => (r.status().as_u16(), r.bytes().await.unwrap_or_default()),
                            Err(e) => (
                                502,
                                bytes::Bytes::from(
                                    json!({"error": {"message": e.to_string()}}).to_string(),
                                ),
                            ),
                        };
                        (route.1)(Routed {
                            summary,
                            body: &body,
                            status,
                            answer: &answer,
                            elapsed: started.elapsed(),
                        });
                        let mut resp = hyper::Response::new(Full::new(answer));
                        *resp.status_mut() = hyper::StatusCode::from_u16(status)
                            .unwrap_or(hyper::StatusCode::BAD_GATEWAY);
                        resp.headers_mut().insert(
                            "content-type",
                            http::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    format!("http://{addr}/v1")
}

/// Says on stderr which facts the compaction's own audit recorded as
/// repaired or forgotten, when any were.
fn report_audit(db: &PathBuf, id: &str, session: &str, window: u64) {
    let Ok(conn) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return;
    };
    let Ok(Some(audit)) =
        conn.query_row("SELECT audit FROM compactions WHERE id = ?1", [id], |r| {
            r.get::<_, Option<String>>(0)
        })
    else {
        return;
    };
    let Ok(audit) = serde_json::from_str::<compactor::compaction::summary::Audit>(&audit) else {
        return;
    };
    let of = |state: compactor::compaction::summary::FactState| -> Vec<&str> {
        audit
            .facts
            .iter()
            .filter(|f| f.state == state)
            .map(|f| f.kind.as_str())
            .collect()
    };
    let (repaired, forgotten) = (
        of(compactor::compaction::summary::FactState::Repaired),
        of(compactor::compaction::summary::FactState::Forgotten),
    );
    if !repaired.is_empty() || !forgotten.is_empty() {
        eprintln!(
            "audit of {session} (window {window}): {} facts checked, repaired {repaired:?}, forgotten {forgotten:?}",
            audit.facts.len()
        );
    }
}

fn rung_of(db: &PathBuf, id: &str) -> Option<String> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .ok()?;
    conn.query_row("SELECT rung FROM compactions WHERE id = ?1", [id], |r| {
        r.get(0)
    })
    .ok()
}

/// Tokens the proxy estimates for a session (to choose windows that force
/// each rung).
pub fn session_tokens(session: &Session) -> u64 {
    let counter = compactor::tokens::TokenCounter::new_warm();
    session
        .messages
        .iter()
        .map(|m| counter.count_item(&compactor::wire::item_hash(m), m))
        .sum()
}

/// Per (rung, kind): (kept, planted).
pub type Table = std::collections::BTreeMap<(String, Kind), (usize, usize)>;

pub fn add(table: &mut Table, g: &Graded) {
    let rung = g.rung.clone().unwrap_or_else(|| "none".into());
    for &(kind, kept) in &g.kept {
        let e = table.entry((rung.clone(), kind)).or_default();
        e.0 += kept as usize;
        e.1 += 1;
    }
}

/// Retained share per rung over all kinds.
pub fn per_rung(table: &Table) -> Vec<(String, usize, usize)> {
    let mut out: Vec<(String, usize, usize)> = Vec::new();
    for ((rung, _), (k, n)) in table {
        match out.iter_mut().find(|r| &r.0 == rung) {
            Some(r) => {
                r.1 += k;
                r.2 += n;
            }
            None => out.push((rung.clone(), *k, *n)),
        }
    }
    out
}

pub fn print_table(title: &str, table: &Table) {
    println!("\n{title}");
    let rungs: Vec<String> = per_rung(table).into_iter().map(|r| r.0).collect();
    print!("{:<14}", "kind");
    for r in &rungs {
        print!("{r:>16}");
    }
    println!();
    for kind in Kind::ALL {
        print!("{:<14}", kind.name());
        for r in &rungs {
            match table.get(&(r.clone(), kind)) {
                Some((k, n)) => print!("{:>16}", format!("{k}/{n}")),
                None => print!("{:>16}", "-"),
            }
        }
        println!();
    }
    print!("{:<14}", "all");
    for (_, k, n) in per_rung(table) {
        print!(
            "{:>16}",
            format!("{k}/{n} {:.0}%", 100.0 * k as f64 / n.max(1) as f64)
        );
    }
    println!();
}
