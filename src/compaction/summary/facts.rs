//! The facts record and its extraction: the task (harness-injected user
//! messages skipped), then every tool call settled against its output, so
//! files, errors, the plan and the tool-call log are merged onto the facts
//! of the compaction this one extends.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::calls::{calls_of, short_args};
use super::edits::{apply_op, effects_of, text_edits, Effect, Op};
use super::errors::{outcome, Outcome};
use super::failures::headline;
use super::shell::{command_of, file_ops, shell_blocks, MAX_COMMAND};
use super::statements::{classify_assistant_line, push_statement, user_statements, Statement};
use super::statements::{push_pinned, reverses, system_blocks};
use super::text::{clip, role};
use super::{
    MAX_COMMANDS, MAX_ERRORS, MAX_FILES, MAX_LOG_OUTCOME, MAX_RULES, MAX_SYSTEM_NOTE,
    MAX_SYSTEM_NOTES, MAX_TOOL_LOG,
};
use crate::compaction::items::{is_summary, is_user_message, outputs, text_of};

/// Facts the proxy extracts deterministically, so they survive any model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Facts {
    /// First real user message, verbatim.
    pub task: Option<String>,
    /// Files touched, ordered by first touch; one entry per path (at most
    /// [`MAX_FILES`]: past it the oldest only read go first, then the
    /// oldest).
    pub files: Vec<FileFact>,
    /// Files left out of `files`.
    pub files_dropped: usize,
    /// Failures of failed tool outputs, each a block of the lines that
    /// carry it, quoted as printed (deduplicated, newest kept, at most
    /// [`MAX_ERRORS`]).
    pub errors: Vec<String>,
    /// Latest plan/todo list, rendered readably with statuses.
    pub plan: Option<String>,
    /// One line per tool call: `name(short args) → ok` or
    /// `→ error: <first error line>` (at most [`MAX_TOOL_LOG`], newest kept).
    pub tool_log: Vec<String>,
    /// The agent's own statements of decisions (`Decision: … because …`),
    /// verbatim, newest kept.
    pub decisions: Vec<String>,
    /// The agent's own statements of what it does next, newest kept.
    pub next_steps: Vec<String>,
    /// Constraints and preferences the user stated after the task, newest
    /// kept (those that are standing rules are in `rules` instead).
    pub constraints: Vec<String>,
    /// Commands run (shell-like calls, aider's reported runs), oldest
    /// first, each with its exit status in the words of the output that
    /// stated it (at most [`MAX_COMMANDS`], newest kept).
    pub commands: Vec<CommandFact>,
    /// Commands left out of `commands`, older than those kept.
    pub commands_dropped: usize,
    /// The user's standing instructions ("from now on…", "never…", "use X
    /// not Y"), verbatim, in order (at most [`MAX_RULES`], newest kept).
    pub rules: Vec<String>,
    /// Rules left out of `rules`.
    pub rules_dropped: usize,
    /// System messages a harness put inside the history as user text
    /// (`<system-reminder>`, `<environment_context>` blocks), verbatim, in
    /// order (at most [`MAX_SYSTEM_NOTES`], newest kept). System-role
    /// items are kept as items (`cut::kept_verbatim`).
    pub system: Vec<String>,
    /// System messages left out of `system`.
    pub system_dropped: usize,
    /// Decisions a later one reversed: (the replaced, the one replacing it).
    pub replaced: Vec<(String, String)>,
}

/// One command of the ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CommandFact {
    /// The command line (its first line, clipped).
    pub command: String,
    /// Its exit status in the words of the output that stated it (a
    /// header, trailer or wrapper line as printed; `exit_code: N` for a
    /// JSON wrapper); else `failed: <its first failure>`, `ok`, `no
    /// output` or `output pruned`.
    pub status: String,
}

impl CommandFact {
    /// The ledger's line for it (and the checklist's fact).
    pub fn line(&self) -> String {
        format!("{} → {}", self.command, self.status)
    }
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

/// What the person typed in a user message: its text parts that are not
/// injected, joined. A harness can put its own block before the prompt in
/// the same message (Claude Code's `<system-reminder>`), so each part is
/// judged alone; a string content is one part.
fn typed_text(item: &Value) -> String {
    let Some(Value::Array(parts)) = item.get("content") else {
        let text = text_of(item);
        return if is_injected(&text) {
            String::new()
        } else {
            text
        };
    };
    parts
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str()))
        .filter(|t| !is_injected(t))
        .collect::<Vec<_>>()
        .join("\n")
}

/// TASK of an assembled summary (for a part that starts with a summary when
/// no previous facts were passed).
fn task_from_summary(text: &str) -> Option<String> {
    let start = text.find("\n## TASK\n")? + "\n## TASK\n".len();
    let end = ["RULES & SYSTEM MESSAGES", "LEDGER", "PLAN STATE"]
        .iter()
        .filter_map(|h| text[start..].find(&format!("\n\n## {h}\n")))
        .min()
        .map(|e| start + e)
        .unwrap_or(text.len());
    let task = &text[start..end];
    (!task.is_empty() && task != "(not recorded)").then(|| task.to_string())
}

/// The command and output in a user message that reports a command's
/// output (aider's `/run` and `/test`: "I ran this command: … And got this
/// output: …", "Fix any errors below, if possible." without the command).
fn command_output(text: &str) -> Option<(Option<&str>, &str)> {
    const RAN: &str = "I ran this command:";
    const GOT: &str = "And got this output:";
    const FIX: &str = "Fix any errors below, if possible.";
    let t = text.trim_start();
    if let Some(rest) = t.strip_prefix(RAN) {
        let i = rest.find(GOT)?;
        let cmd = rest[..i].trim();
        return Some(((!cmd.is_empty()).then_some(cmd), &rest[i + GOT.len()..]));
    }
    t.trim_start_matches('#')
        .trim_start()
        .strip_prefix(FIX)
        .map(|o| (None, o))
}

/// Records a command and how it ended; past [`MAX_COMMANDS`] the oldest
/// are counted, not kept.
fn push_command(facts: &mut Facts, command: &str, out: Option<&Outcome>) {
    let status = match out {
        None => "no output".to_string(),
        Some(o) if o.pruned => "output pruned".to_string(),
        Some(o) => match (&o.status, o.failed) {
            (Some(w), _) => w.clone(),
            (None, true) => match o.errors.first() {
                Some(e) => format!("failed: {}", headline(e)),
                None => "failed".to_string(),
            },
            (None, false) => "ok".to_string(),
        },
    };
    facts.commands.push(CommandFact {
        command: clip(command, MAX_COMMAND),
        status: clip(&status, MAX_LOG_OUTCOME),
    });
    if facts.commands.len() > MAX_COMMANDS {
        let n = facts.commands.len() - MAX_COMMANDS;
        facts.commands.drain(..n);
        facts.commands_dropped += n;
    }
}

fn push_error(errors: &mut Vec<String>, line: String) {
    errors.retain(|e| *e != line);
    errors.push(line);
    if errors.len() > MAX_ERRORS {
        errors.drain(..errors.len() - MAX_ERRORS);
    }
}

struct Pending {
    line: usize,
    effects: Vec<Effect>,
    /// The command line, for a shell-like call.
    command: Option<String>,
}

fn settle(facts: &mut Facts, log: &mut [String], p: Pending, out: Option<&Outcome>) {
    let suffix = match out {
        None => "no output".to_string(),
        Some(o) if o.pruned => "output pruned".to_string(),
        Some(o) if o.failed => {
            // A failure's block opens with its marker or, for `go test -v`,
            // its detail line: either names it. The words that stated the
            // exit status go first, so a clipped line keeps the code.
            let first = o.errors.first().map(|e| headline(e).to_string());
            match (&o.status, first) {
                (Some(w), Some(f)) if f != *w => format!("error ({w}): {f}"),
                (Some(w), _) => format!("error: {w}"),
                (None, Some(f)) => format!("error: {f}"),
                (None, None) => match o.exit {
                    Some(c) => format!("error: exit code {c}"),
                    None => "error: failed".to_string(),
                },
            }
        }
        Some(_) => "ok".to_string(),
    };
    log[p.line] = format!("{} → {}", log[p.line], clip(&suffix, MAX_LOG_OUTCOME));
    if let Some(c) = &p.command {
        push_command(facts, c, out);
    }
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
            Effect::File(path, op) => apply_file(facts, path, op),
        }
    }
}

/// What the assistant's own text records: its decisions and next steps,
/// and the edits it wrote as SEARCH/REPLACE blocks (they take effect as
/// written: no tool output reports on them).
fn assistant_text(facts: &mut Facts, text: &str) {
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        match classify_assistant_line(line) {
            Some((Statement::Decision, s)) => {
                if reverses(&s) {
                    // The newest earlier decision not already replaced.
                    let old = facts
                        .decisions
                        .iter()
                        .rev()
                        .find(|d| **d != s && !facts.replaced.iter().any(|(r, _)| r == *d));
                    if let Some(old) = old {
                        facts.replaced.push((old.clone(), s.clone()));
                    }
                }
                push_statement(&mut facts.decisions, s);
                let kept = &facts.decisions;
                facts.replaced.retain(|(old, _)| kept.contains(old));
            }
            Some((Statement::NextStep, s)) => push_statement(&mut facts.next_steps, s),
            None => {}
        }
    }
    for (path, op) in text_edits(text) {
        apply_file(facts, path, op);
    }
    // aider suggests shell commands in fenced blocks, and runs them.
    for block in shell_blocks(text) {
        for (path, op) in file_ops(&block) {
            apply_file(facts, path, op);
        }
    }
}

/// Records `op` on `path`; past [`MAX_FILES`] the oldest file only read,
/// else the oldest, is counted instead of kept.
fn apply_file(facts: &mut Facts, path: String, op: Op) {
    apply_op(&mut facts.files, path, op);
    while facts.files.len() > MAX_FILES {
        let i = facts
            .files
            .iter()
            .position(|f| f.action == "read")
            .unwrap_or(0);
        facts.files.remove(i);
        facts.files_dropped += 1;
    }
}

/// The context blocks of a user message a harness injected (pinned), each
/// text part read.
fn pin_system_blocks(facts: &mut Facts, item: &Value) {
    let texts: Vec<String> = match item.get("content") {
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str()))
            .map(String::from)
            .collect(),
        _ => vec![text_of(item)],
    };
    for t in texts {
        if !t.contains('<') {
            continue;
        }
        for b in system_blocks(&t, MAX_SYSTEM_NOTE) {
            push_pinned(
                &mut facts.system,
                &mut facts.system_dropped,
                b,
                MAX_SYSTEM_NOTES,
            );
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
        if is_user_message(item) {
            pin_system_blocks(&mut facts, item);
            let text = typed_text(item);
            if let Some((command, output)) = command_output(&text) {
                // aider hands command output back as a user message.
                let out = outcome(output);
                if let Some(c) = command {
                    let line = c.lines().next().unwrap_or(c);
                    push_command(&mut facts, line, Some(&out));
                }
                if out.failed {
                    out.errors
                        .iter()
                        .for_each(|e| push_error(&mut facts.errors, e.clone()));
                }
            } else if !is_injected(&text) {
                if facts.task.is_none() {
                    facts.task = Some(text);
                } else {
                    for (rule, c) in user_statements(&text) {
                        if rule {
                            push_pinned(&mut facts.rules, &mut facts.rules_dropped, c, MAX_RULES);
                        } else {
                            push_statement(&mut facts.constraints, c);
                        }
                    }
                }
            }
        } else if facts.task.is_none() && is_summary(item) {
            facts.task = task_from_summary(&text_of(item));
        }
        if role(item) == "assistant" {
            assistant_text(&mut facts, &text_of(item));
        }
        // A system message in the middle of the conversation (Claude Code
        // sends them) is kept verbatim beside the summary, and none of its
        // lines is the user's.
        for call in calls_of(item) {
            let line = log.len();
            log.push(format!("{}({})", call.name, short_args(&call)));
            let p = Pending {
                line,
                effects: effects_of(&call.name, &call.args),
                command: command_of(&call.name, &call.args),
            };
            match (&call.inline, call.id.is_empty()) {
                (Some(o), _) => settle(&mut facts, &mut log, p, Some(o)),
                (None, true) => unnamed.push(p),
                (None, false) => {
                    pending.insert(call.id, p);
                }
            }
        }
        for (id, text, flagged) in outputs(item) {
            let mut out = outcome(&text);
            // A harness that flags the result itself (Anthropic's and Claude
            // Code's `is_error`, a `status` of `error`) is believed over the text.
            let flagged = flagged
                || item.get("is_error") == Some(&Value::Bool(true))
                || matches!(
                    item.get("status").and_then(Value::as_str),
                    Some("error" | "failed")
                );
            if flagged && !out.failed {
                out = Outcome::failed_with(&text);
            }
            match (!id.is_empty()).then(|| pending.remove(id)).flatten() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::items::user_message;
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;
    use serde_json::json;

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
        assert_eq!(f.errors, vec![TRACEBACK.trim_end().to_string()]);
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
            vec![
                "Traceback (most recent call last):\nNameError: name 'x' is not defined"
                    .to_string()
            ],
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

    /// Claude Code's first user message is one message of two text blocks:
    /// a `<system-reminder>` it injects, then what the person typed. The
    /// typed block is the task; the reminder is not part of it.
    #[test]
    fn a_typed_block_after_an_injected_one_in_the_same_message_is_the_task() {
        let first = json!({"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# currentDate\nToday's date is 2026-12-01.\n</system-reminder>\n\n"},
            {"type": "text", "text": "Task: reconcile the ledger; the codeword is MAGPIE-7.",
             "cache_control": {"type": "ephemeral"}}]});
        let later = json!({"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nThe date changed.\n</system-reminder>"},
            {"type": "text", "text": "Do not touch the public API."}]});
        let f = extract_facts(&[first, later], None);
        assert_eq!(
            f.task.as_deref(),
            Some("Task: reconcile the ledger; the codeword is MAGPIE-7.")
        );
        assert_eq!(f.rules, ["Do not touch the public API."], "a standing rule");
        // The reminders are pinned, verbatim and in order.
        assert_eq!(
            f.system,
            [
                "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# currentDate\nToday's date is 2026-12-01.\n</system-reminder>",
                "<system-reminder>\nThe date changed.\n</system-reminder>"
            ]
        );
    }

    /// A system message in the middle of the conversation is not the
    /// user's: none of its lines is a constraint the user stated (it is
    /// kept verbatim beside the summary instead), nor the task.
    #[test]
    fn a_mid_conversation_system_message_is_not_read_as_the_users() {
        let part = vec![
            json!({"role": "system", "content": "You must answer in French.\nAlways run the tests first."}),
            json!({"role": "user", "content": "Fix the flaky test."}),
            json!({"role": "system", "content": "Reminder from the harness.\nNever push to main without a review."}),
            json!({"role": "developer", "content": "Do not use the network."}),
            json!({"role": "assistant", "content": "On it."}),
            json!({"role": "user", "content": "Also, never touch the CI config."}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.task.as_deref(), Some("Fix the flaky test."));
        assert!(f.constraints.is_empty(), "{:?}", f.constraints);
        assert_eq!(
            f.rules,
            vec!["Also, never touch the CI config.".to_string()],
            "only what the user typed"
        );
    }

    /// aider reports a command's output as a user message: its failures
    /// are read, and it is neither the task nor a constraint.
    #[test]
    fn aider_command_output_in_a_user_message_is_read_for_failures() {
        let part = vec![
            json!({"role": "user", "content": "Fix the VAT rounding."}),
            json!({"role": "user", "content": "I ran this command:\n\npytest -q\n\nAnd got this output:\n\nE       AssertionError: vat for 10 should be 2.5\ntest_tax.py:5: AssertionError\n1 failed in 0.02s\nnever mind the warnings\n"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.task.as_deref(), Some("Fix the VAT rounding."));
        assert_eq!(
            f.errors,
            vec![
                "E       AssertionError: vat for 10 should be 2.5\ntest_tax.py:5: AssertionError"
                    .to_string()
            ]
        );
        assert!(f.constraints.is_empty(), "{:?}", f.constraints);
    }

    /// The ledger, the rules and the system messages of a first compaction
    /// carry through the next: rules and reminders in order, once; the
    /// commands newest first; a decision reversed in the second part is
    /// marked replaced.
    #[test]
    fn the_trail_carries_through_a_later_compaction() {
        let first = vec![
            json!({"role": "user", "content": "Move the retry settings to config/retry.toml."}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\ncwd: /srv/api\n</system-reminder>"},
                {"type": "text", "text": "From now on, run make lint before each commit."}]}),
            json!({"role": "assistant", "content": "Decision: keep the state in Redis because lookups must be fast."}),
            chat_call("1", "bash", json!({"command": "make test"})),
            chat_out(
                "1",
                "<returncode>2</returncode>\n<output>\nFAIL retry\n</output>",
            ),
        ];
        let f1 = extract_facts(&first, None);
        let summary = assemble(&f1, None, first.len(), 100_000);
        let second = vec![
            user_message(summary),
            json!({"role": "user", "content": "Use pnpm, not npm."}),
            json!({"role": "assistant", "content": "Decision: keep the state in Postgres instead of Redis, because the deploy has no Redis."}),
            chat_call(
                "2",
                "bash",
                json!({"command": "rm old/env.rs && make test"}),
            ),
            chat_out("2", "<returncode>0</returncode>\n<output>\nok\n</output>"),
        ];
        let f2 = extract_facts(&second, Some(&f1));
        assert_eq!(
            f2.rules,
            [
                "From now on, run make lint before each commit.",
                "Use pnpm, not npm."
            ]
        );
        assert_eq!(
            f2.system,
            ["<system-reminder>\ncwd: /srv/api\n</system-reminder>"]
        );
        assert_eq!(file(&f2, "old/env.rs").action, "delete");
        let s = assemble(&f2, None, second.len(), 100_000);
        let newest = s
            .find("- rm old/env.rs && make test → <returncode>0</returncode>")
            .unwrap_or_else(|| panic!("{s}"));
        let oldest = s.find("- make test → <returncode>2</returncode>").unwrap();
        assert!(newest < oldest, "newest first: {s}");
        let rules = s.find("## RULES & SYSTEM MESSAGES").unwrap();
        assert!(
            rules < s.find("## LEDGER").unwrap()
                && s.find("## LEDGER").unwrap() < s.find("## PLAN STATE").unwrap()
        );
        let replaced = s
            .lines()
            .find(|l| {
                l.ends_with("] Decision: keep the state in Redis because lookups must be fast.")
            })
            .unwrap_or_else(|| panic!("{s}"));
        assert!(
            replaced.starts_with(
                "- [REPLACED by the later decision \"Decision: keep the state in Postgres"
            ),
            "{replaced}"
        );
        assert!(!previous_narrative(&assemble(&f2, Some(GOOD), 4, 100_000)).contains("## LEDGER"));
    }

    #[test]
    fn facts_serde_round_trip() {
        let f = sample_facts();
        let back: Facts = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back, f);
        let partial: Facts = serde_json::from_str(r#"{"task": "x"}"#).unwrap();
        assert_eq!(partial.task.as_deref(), Some("x"));
    }
}
