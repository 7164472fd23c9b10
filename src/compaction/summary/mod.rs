//! Rung 3, the pure half: the facts the proxy extracts itself, the
//! summarizer prompt, validation of the model's answer, and the assembled
//! summary message (or its deterministic fallback when the model failed).
//!
//! Hard facts never depend on the summarizer model's skill: the
//! task verbatim, the user's standing rules and the system messages inside
//! the conversation, a ledger of every file touched and every command run
//! with its exit status, the files' content (or the changes written to
//! them), exact error lines of failed tool calls, the latest plan and a
//! one-line-per-call log are extracted here, deterministically, and placed
//! by [`assemble`] before and beside the six narrative sections the model
//! writes.
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
//!   `rm`, `mv` (and their `git` forms) and Python one-liners that open a
//!   file for writing, in shell calls and in aider's suggested shell
//!   blocks, delete, rename and write.
//! - failure: a non-zero exit code when the output states one (Codex's
//!   `Process exited with code N`, Claude Code's `Exit code N`, JSON
//!   `metadata.exit_code` / `exit_code`, a one-`bash` agent's
//!   `<returncode>N</returncode>`, OpenHands' `[The command completed with
//!   exit code N.]`, pnpm's `Command failed with exit code N.`, an
//!   `is_error` result); otherwise the markers of the common toolchains,
//!   read as blocks: the marker and the lines beside it that carry the
//!   message (`failures`).
//! - commands: each shell-like call's command line (and aider's "I ran
//!   this command:"), with the line of its output that stated the exit
//!   status, as printed.
//! - rules: lines the user typed after the task that hold from now on
//!   ("from now on…", "never…", "always…", "don't…", "use X not Y");
//!   system messages: the `<system-reminder>` and `<environment_context>`
//!   blocks a harness puts in user messages (system-role items are kept as
//!   items). A decision that says it reverses ("instead", "revert", …)
//!   marks the newest earlier one replaced.
//!
//! Where each part lives (this file only declares the parts and hands
//! their names on; what they share is a part of its own, which they name):
//!
//! - `facts`: the [`Facts`] record, the task, [`extract_facts`]
//! - `limits`: how much of each kind of fact is kept
//! - `labels`: the narrative sections, the summarizer's marker, the
//!   labels the proxy writes
//! - `calls`: tool calls in the four wire formats, the tool-log line
//! - `errors`: exit status and exact failures of a tool output
//! - `failures`: failure markers and the blocks quoted around them
//! - `edits`: patches, edits, writes, heredocs and their effect on files
//!   (each file's [`FileFact`])
//! - `shell`: deletes, renames and Python writes in shell commands; a
//!   shell call's command line
//! - `plan`: plan and todo tools
//! - `statements`: the agent's decisions (and which reversed which) and
//!   next steps, the user's constraints and standing rules, the context
//!   blocks a harness injects
//! - `ledger`: the LEDGER and RULES sections of the summary
//! - `prompt`: the transcript and the summarizer prompt
//! - `narrative`: reading and validating the model's answer
//! - `assemble`: the summary message within its budget
//! - `checklist`: each extracted fact, present in a compacted request or not
//! - `audit`: a compaction's checklist as stored, its repairs and what it forgot
//! - `text`: small string helpers

mod assemble;
mod audit;
mod calls;
mod checklist;
mod edits;
mod errors;
mod facts;
mod failures;
mod handoff;
mod labels;
mod ledger;
mod limits;
mod narrative;
mod ops;
mod plan;
mod prompt;
mod shell;
mod statements;
mod text;

pub use assemble::{assemble, previous_narrative, with_notes};
pub use audit::{
    audit_and_repair, repair_block, sent_text, to_repair, Audit, Audited, AuditedFact, FactState,
    MAX_FACT_BYTES, MAX_REMOVED_REFS,
};
pub use checklist::{checklist, Check, FactKind};
pub use edits::FileFact;
pub use errors::{is_error_line, output_digest};
pub use facts::{extract_facts, is_injected, CommandFact, Facts};
pub use handoff::{
    carried_text, carried_texts, is_handoff, left_out, trail_of, with_block, HANDOFF_NOTE,
};
pub use labels::{NARRATIVE_SECTIONS, SUMMARIZER_MARKER};
pub use limits::{
    MAX_CHANGE_CHAIN, MAX_COMMANDS, MAX_ERRORS, MAX_FILES, MAX_FILE_CONTENT, MAX_RULES,
    MAX_SYSTEM_NOTE, MAX_SYSTEM_NOTES, MAX_TOOL_LOG,
};
pub use narrative::{usable, validate};
pub use prompt::{cached_instruction, render_transcript, retry_messages, summarizer_messages};

#[cfg(test)]
pub(crate) mod testing {
    //! Items and facts shared by the summary modules' tests.
    use super::*;
    use serde_json::{json, Value};

    pub(crate) fn chat_call(id: &str, name: &str, args: Value) -> Value {
        json!({"role": "assistant", "content": null,
               "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]})
    }

    pub(crate) fn chat_out(id: &str, content: &str) -> Value {
        json!({"role": "tool", "tool_call_id": id, "content": content})
    }

    pub(crate) fn fc(id: &str, name: &str, args: Value) -> Value {
        json!({"type": "function_call", "call_id": id, "name": name, "arguments": args.to_string()})
    }

    pub(crate) fn fco(id: &str, output: &str) -> Value {
        json!({"type": "function_call_output", "call_id": id, "output": output})
    }

    pub(crate) fn umsg(text: &str) -> Value {
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    }

    pub(crate) fn file<'a>(f: &'a Facts, path: &str) -> &'a FileFact {
        f.files
            .iter()
            .find(|x| x.path == path)
            .unwrap_or_else(|| panic!("no {path} in {:?}", f.files))
    }

    pub(crate) const AUTH_PATCH: &str = "*** Begin Patch\n*** Update File: src/auth.py\n@@ def check(cookie):\n-    max_age = 60\n+    max_age = 3600\n*** End Patch";

    pub(crate) const TRACEBACK: &str = "Traceback (most recent call last):\n  File \"app.py\", line 3, in <module>\n    s = req['session']\nKeyError: 'session'\n";

    pub(crate) const GOOD: &str = "## PLAN STATE\n- fix cookie (in progress)\n\n## DECISIONS\n- max_age 3600: sessions last an hour\n\n## FILE/WORKSPACE STATE\n- src/auth.py: max_age now 3600\n\n## CONSTRAINTS & PREFERENCES\n- no new deps\n\n## ERRORS & FIXES\n- `KeyError: 'session'` fixed by default\n\n## OPEN ITEMS / NEXT STEP\n- run tests\n";

    pub(crate) fn sample_facts() -> Facts {
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
}
