//! The trail of work: sessions in eight agents' vocabularies that plant
//! what users complain a compaction loses — every file the session
//! created, edited, deleted, renamed or wrote from a Python one-liner;
//! the commands it ran, each with its exit status as that agent's output
//! states it; the user's standing rules; a system message in the middle of
//! the conversation; a decision that reversed an earlier one.
//!
//! A command is kept when one line of what the upstream received (its
//! strings decoded) holds both the command and its status, the status in
//! the words of the output that stated it (`Exit code 2`, `Process
//! exited with code 5`, `Exit code: 1`, `exit_code: 127` for a JSON
//! wrapper, `<returncode>1</returncode>`, `[The command completed with exit
//! code 2.]`, `ELIFECYCLE  Command failed with exit code 1.`), `ok` when a
//! successful output states none, `failed` for aider's reported runs. The
//! other kinds are graded by the planted text itself.

use serde_json::{json, Value};

use super::{filler_turns, Builder, Fact, Kind, Rng, Session, Turns, SETTINGS, WORDS};

/// The vocabularies.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Voc {
    ClaudeCode,
    Opencode,
    CodexExec,
    CodexShell,
    CodexJson,
    OneBash,
    OpenHands,
    Aider,
}

const VOCS: [Voc; 8] = [
    Voc::ClaudeCode,
    Voc::Opencode,
    Voc::CodexExec,
    Voc::CodexShell,
    Voc::CodexJson,
    Voc::OneBash,
    Voc::OpenHands,
    Voc::Aider,
];

impl Voc {
    fn name(self) -> &'static str {
        match self {
            Voc::ClaudeCode => "trail: Claude Code",
            Voc::Opencode => "trail: opencode + pnpm",
            Voc::CodexExec => "trail: Codex exec_command",
            Voc::CodexShell => "trail: Codex shell (text)",
            Voc::CodexJson => "trail: Codex shell (JSON)",
            Voc::OneBash => "trail: one bash tool",
            Voc::OpenHands => "trail: OpenHands",
            Voc::Aider => "trail: aider",
        }
    }

    fn system(self) -> &'static str {
        match self {
            Voc::ClaudeCode => "You are Claude Code, a CLI coding assistant.",
            Voc::Opencode => "You are opencode, an interactive CLI coding agent.",
            Voc::CodexExec | Voc::CodexShell | Voc::CodexJson => {
                "You are Codex, a coding agent running in a terminal."
            }
            Voc::OneBash => "You are a coding agent with one tool: bash.",
            Voc::OpenHands => "You are OpenHands agent, a helpful AI assistant.",
            Voc::Aider => "Act as an expert software developer.",
        }
    }

    fn tools(self) -> Vec<Value> {
        let schema = |name: &str, props: &[&str]| {
            let properties: serde_json::Map<String, Value> = props
                .iter()
                .map(|p| (p.to_string(), json!({"type": "string"})))
                .collect();
            json!({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}})
        };
        match self {
            Voc::ClaudeCode => vec![
                schema("Bash", &["command"]),
                schema("Read", &["file_path"]),
                schema("Write", &["file_path", "content"]),
                schema("Edit", &["file_path", "old_string", "new_string"]),
            ],
            Voc::Opencode => vec![
                schema("bash", &["command", "description"]),
                schema("write", &["filePath", "content"]),
                schema("edit", &["filePath", "oldString", "newString"]),
            ],
            Voc::CodexExec => vec![schema("exec_command", &["cmd"])],
            Voc::CodexShell | Voc::CodexJson => vec![schema("shell", &["command"])],
            Voc::OneBash => vec![schema("bash", &["command"])],
            Voc::OpenHands => vec![
                schema("execute_bash", &["command"]),
                schema("str_replace_editor", &["command", "path"]),
            ],
            Voc::Aider => Vec::new(),
        }
    }
}

struct Trail {
    voc: Voc,
    b: Builder,
}

impl Trail {
    /// Runs `cmd`, whose output is `body` and exit code `exit`, in the
    /// vocabulary; returns the status the ledger must show for it.
    fn run(&mut self, text: Option<&str>, cmd: &str, body: &str, exit: i64) -> String {
        let (name, args, output, status) = match self.voc {
            Voc::ClaudeCode => {
                let (out, st) = if exit == 0 {
                    (body.to_string(), "ok".to_string())
                } else {
                    (format!("Exit code {exit}\n{body}"), format!("Exit code {exit}"))
                };
                ("Bash", json!({"command": cmd, "description": "Run it"}), out, st)
            }
            Voc::Opencode => {
                // pnpm states the code on its own line; other commands do not.
                let (out, st) = if exit != 0 && cmd.starts_with("pnpm") {
                    let line = format!("ELIFECYCLE  Command failed with exit code {exit}.");
                    (format!("{body}\n {line}\n"), line)
                } else if exit == 0 {
                    (body.to_string(), "ok".to_string())
                } else {
                    (body.to_string(), "failed".to_string())
                };
                ("bash", json!({"command": cmd, "description": "Runs it"}), out, st)
            }
            Voc::CodexExec => (
                "exec_command",
                json!({"cmd": cmd}),
                format!("Chunk ID: 7\nWall time: 0.4 seconds\nProcess exited with code {exit}\nOriginal token count: 90\nOutput:\n{body}"),
                format!("Process exited with code {exit}"),
            ),
            Voc::CodexShell => (
                "shell",
                json!({"command": ["bash", "-lc", cmd]}),
                format!("Exit code: {exit}\nWall time: 0.3 seconds\nOutput:\n{body}"),
                format!("Exit code: {exit}"),
            ),
            Voc::CodexJson => (
                "shell",
                json!({"command": ["bash", "-lc", cmd]}),
                json!({"output": body, "metadata": {"exit_code": exit, "duration_seconds": 0.3}})
                    .to_string(),
                format!("exit_code: {exit}"),
            ),
            Voc::OneBash => (
                "bash",
                json!({"command": cmd}),
                format!("<returncode>{exit}</returncode>\n<output>\n{body}</output>"),
                format!("<returncode>{exit}</returncode>"),
            ),
            Voc::OpenHands => {
                let line = format!("[The command completed with exit code {exit}.]");
                (
                    "execute_bash",
                    json!({"command": cmd}),
                    format!("{body}\n{line}\n[Current working directory: /workspace]"),
                    line,
                )
            }
            Voc::Aider => {
                if let Some(t) = text {
                    self.b.assistant(t);
                }
                self.b.user(&format!(
                    "I ran this command:\n\n{cmd}\n\nAnd got this output:\n\n{body}\n"
                ));
                self.b.assistant("Ok.");
                return if exit == 0 { "ok" } else { "failed" }.to_string();
            }
        };
        self.b.call(text, name, args, &output);
        status
    }

    /// Writes a new file.
    fn create(&mut self, path: &str, content: &str) {
        match self.voc {
            Voc::ClaudeCode => self.b.call(
                None,
                "Write",
                json!({"file_path": path, "content": content}),
                &format!("File created successfully at: {path}"),
            ),
            Voc::Opencode => self.b.call(
                None,
                "write",
                json!({"filePath": path, "content": content}),
                "",
            ),
            Voc::CodexExec | Voc::CodexShell | Voc::CodexJson => {
                let body: String = content.lines().map(|l| format!("+{l}\n")).collect();
                let patch = format!("*** Begin Patch\n*** Add File: {path}\n{body}*** End Patch");
                self.run(
                    None,
                    &format!("apply_patch <<'EOF'\n{patch}\nEOF"),
                    "Success. Updated the following files:\nA {path}\n",
                    0,
                );
            }
            Voc::OneBash => {
                self.run(None, &format!("cat > {path} <<'EOF'\n{content}EOF"), "", 0);
            }
            Voc::OpenHands => self.b.call(
                None,
                "str_replace_editor",
                json!({"command": "create", "path": path, "file_text": content}),
                &format!("File created successfully at: {path}"),
            ),
            Voc::Aider => self.b.assistant(&format!(
                "{path}\n```\n<<<<<<< SEARCH\n=======\n{content}>>>>>>> REPLACE\n```\n"
            )),
        }
    }

    /// Replaces `old` with `new` in `path`.
    fn edit(&mut self, path: &str, old: &str, new: &str) {
        match self.voc {
            Voc::ClaudeCode => self.b.call(
                None,
                "Edit",
                json!({"file_path": path, "old_string": old, "new_string": new}),
                &format!("The file {path} has been updated."),
            ),
            Voc::Opencode => self.b.call(
                None,
                "edit",
                json!({"filePath": path, "oldString": old, "newString": new}),
                "",
            ),
            Voc::CodexExec | Voc::CodexShell | Voc::CodexJson => {
                let patch = format!(
                    "*** Begin Patch\n*** Update File: {path}\n@@\n-{old}\n+{new}\n*** End Patch"
                );
                self.run(
                    None,
                    &format!("apply_patch <<'EOF'\n{patch}\nEOF"),
                    &format!("Success. Updated the following files:\nM {path}\n"),
                    0,
                );
            }
            Voc::OneBash => {
                self.run(None, &format!("sed -i 's|{old}|{new}|' {path}"), "", 0);
            }
            Voc::OpenHands => self.b.call(
                None,
                "str_replace_editor",
                json!({"command": "str_replace", "path": path, "old_str": old, "new_str": new}),
                &format!("The file {path} has been edited."),
            ),
            Voc::Aider => self.b.assistant(&format!(
                "{path}\n```\n<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE\n```\n"
            )),
        }
    }

    /// Runs shell file operations (`rm`, `mv`, a Python one-liner): aider
    /// suggests them in a shell block, the others run them.
    fn shell_ops(&mut self, cmd: &str) {
        if self.voc == Voc::Aider {
            self.b.assistant(&format!(
                "Run this to finish the cleanup:\n\n```bash\n{cmd}\n```\n"
            ));
        } else {
            self.run(None, cmd, "", 0);
        }
    }

    /// A system message in the middle of the conversation, as the agent's
    /// harness sends it: Claude Code's `<system-reminder>` beside the
    /// user's words, Codex's `<environment_context>`, a system message
    /// otherwise.
    fn system_message(&mut self, body: &str) -> String {
        match self.voc {
            Voc::ClaudeCode => {
                let block = format!("<system-reminder>\n{body}\n</system-reminder>");
                self.b.messages.push(json!({"role": "user", "content": [
                    {"type": "text", "text": block},
                    {"type": "text", "text": "Carry on with the task."}]}));
            }
            Voc::CodexExec | Voc::CodexShell | Voc::CodexJson => {
                self.b.user(&format!(
                    "<environment_context>\n  <cwd>{body}</cwd>\n</environment_context>"
                ));
            }
            _ => self
                .b
                .messages
                .push(json!({"role": "system", "content": body})),
        }
        body.to_string()
    }

    /// `n` filler turns: reads, builds and passing test runs.
    fn filler(&mut self, n: usize, bytes: usize) {
        filler_turns(self, n, bytes);
    }
}

impl Turns for Trail {
    fn builder(&mut self) -> &mut Builder {
        &mut self.b
    }
    fn read_file(&mut self, path: &str, content: &str) {
        if self.voc == Voc::Aider {
            self.b.user(&format!("{path}\n```\n{content}```\n"));
            self.b.assistant("Ok, I have the file.");
        } else {
            self.run(None, &format!("cat {path}"), content, 0);
        }
    }
    fn run_shell(&mut self, cmd: &str, output: &str) {
        self.run(None, cmd, output, 0);
    }
}

/// A failing command's output (a few lines, then a log of `bytes`).
fn failing_output(r: &mut Rng, what: &str, bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes {
        s.push_str(&format!(
            "[{}] {} {} checked\n",
            r.next() % 900,
            r.pick(WORDS),
            r.pick(WORDS)
        ));
    }
    s.push_str(what);
    s.push('\n');
    s
}

/// Eight sessions, one per vocabulary, each planting its trail early (in
/// the part that is compacted) under tens of KB of output.
pub fn trail_sessions(scale: f64) -> Vec<Session> {
    let topics = [
        ("payouts", "P1"),
        ("invoices", "N8"),
        ("catalog", "C2"),
        ("metrics", "E4"),
        ("refunds", "F3"),
        ("alerts", "L2"),
        ("shipping", "H9"),
        ("search", "S5"),
    ];
    let filler_bytes = ((24_000.0 * scale) as usize).max(2_000);
    let turns = |n: usize| ((n as f64 * scale).round() as usize).max(1);
    let mut out = Vec::new();
    for (k, (&voc, (topic, tag))) in VOCS.iter().zip(topics).enumerate() {
        let task = format!("Move the {topic} service's retry settings into config/{topic}.toml (ticket {tag}-{k}30) and delete the old env parsing.");
        let mut t = Trail {
            voc,
            b: Builder::new(0x7A11 ^ k as u64, &task),
        };
        t.b.messages[0] = json!({"role": "system", "content": voc.system()});
        let mut facts = vec![Fact {
            kind: Kind::Task,
            needle: task.clone(),
        }];
        t.filler(turns(1), filler_bytes);
        // A system message early on: the harness's new working directory
        // and the tools it defers.
        let cwd = format!("/srv/{topic}-{tag}/service");
        let sys = match voc {
            Voc::CodexExec | Voc::CodexShell | Voc::CodexJson => cwd.clone(),
            _ => format!("The working directory is now {cwd}. Deferred tools available: NotebookEdit, WebFetch_{tag}."),
        };
        let needle = t.system_message(&sys);
        facts.push(Fact {
            kind: Kind::SystemMessage,
            needle,
        });
        t.filler(turns(1), filler_bytes);
        // A decision, reversed later.
        let first = format!(
            "Decision: keep the {topic} retry state in Redis because lookups must be fast."
        );
        let second = format!("Decision: keep the {topic} retry state in Postgres instead of Redis, because the {tag} deploy has no Redis.");
        t.b.assistant(&first);
        // Files: created, edited, deleted, renamed, written by Python.
        let created = format!("config/{topic}_{tag}.toml");
        let edited = format!("services/{topic}/src/retry_{tag}.rs");
        let deleted = format!("services/{topic}/src/env_{tag}.rs");
        let (renamed, renamed_to) = (
            format!("docs/{topic}_{tag}_retries.md"),
            format!("docs/{topic}/retries_{tag}.md"),
        );
        let written = format!("fixtures/{topic}_{tag}_limits.json");
        t.create(
            &created,
            &format!("[retry]\nmax_attempts = {}\nbackoff_ms = 250\n", 3 + k),
        );
        t.create(&edited, SETTINGS);
        t.edit(
            &edited,
            "    pub zone: Zone,",
            &format!("    pub retries_{tag}: RetryPolicy,"),
        );
        t.shell_ops(&format!("rm {deleted}"));
        t.shell_ops(&format!("mv {renamed} {renamed_to}"));
        t.shell_ops(&format!(
            "python3 -c \"open('{written}', 'w').write('{{\\\"max\\\": {k}}}')\""
        ));
        for p in [&created, &edited, &deleted, &renamed, &renamed_to, &written] {
            facts.push(Fact {
                kind: Kind::FileChanged,
                needle: p.to_string(),
            });
        }
        t.filler(turns(1), filler_bytes);
        // The user's standing rules.
        let rules = [
            format!("From now on, run the {topic} tests with --locked before every commit."),
            format!("Never touch infra/terraform_{tag}/, another team owns it."),
            if voc == Voc::Opencode {
                "Use pnpm, not npm, in this repository.".to_string()
            } else {
                format!("Always use the {topic}_{tag} feature flag for new code paths.")
            },
        ];
        t.b.user(&rules.join("\n"));
        for r in &rules {
            facts.push(Fact {
                kind: Kind::Rule,
                needle: r.clone(),
            });
        }
        // Commands with their exit status: three failures, one success.
        let mut r = Rng(0xC0DE ^ k as u64);
        let runner = if voc == Voc::Opencode { "pnpm" } else { "make" };
        let cmds = [
            (format!("{runner} test -- {topic}_{tag}"), failing_output(&mut r, &format!("FAILED tests/test_{topic}.py::test_retry_budget_{tag} - AssertionError: expected 3 attempts, got 4"), filler_bytes / 4), 1),
            (format!("{runner} run lint:{topic}"), failing_output(&mut r, &format!("error: unused import `RetryPolicy{tag}` in {topic}/retry.rs"), filler_bytes / 8), 2),
            (format!("./scripts/migrate_{tag}.sh --dry-run"), format!("bash: psql_{tag}: command not found"), 127),
            (format!("git diff --stat -- services/{topic}"), format!(" services/{topic}/src/retry_{tag}.rs | 2 +-\n 1 file changed\n"), 0),
        ];
        for (i, (cmd, body, exit)) in cmds.iter().enumerate() {
            let text = (i == 1).then_some(second.as_str());
            let status = t.run(text, cmd, body, *exit);
            facts.push(Fact {
                kind: Kind::Command,
                needle: format!("{cmd} → {status}"),
            });
            if i == 1 {
                facts.push(Fact {
                    kind: Kind::Reversal,
                    needle: format!("keep the {topic} retry state in Postgres instead of Redis"),
                });
            }
        }
        t.filler(turns(5), filler_bytes);
        t.b.user("Keep going.");
        match voc {
            // aider's reads are user messages; the newest stays whole.
            Voc::Aider => t.b.assistant("Now the remaining callers."),
            _ => t.filler(1, filler_bytes / 4),
        }
        out.push(Session {
            name: voc.name(),
            messages: t.b.messages,
            facts,
            tools: voc.tools(),
        });
    }
    out
}
