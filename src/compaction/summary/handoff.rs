//! After a client's own compaction (Claude Code at its window, Codex at
//! 90% of it, Gemini CLI at half of it), the client goes on from its own
//! summary: a user message that opens with the client's hand-off words,
//! or Gemini CLI's `<state_snapshot>`. What that summary left
//! out of the trail — the user's standing rules, the files changed, the
//! commands run with their exit status — the proxy still holds, extracted
//! from the history the client's compaction request carried; the block
//! [`left_out`] writes is appended once to that hand-off message, the same
//! bytes on every later request, so the upstream's cache of the prefix
//! holds.

use serde_json::Value;

use super::facts::{extract_facts, Facts};
use super::labels::FACTS_LABEL;
use super::ledger::{ledger_block, rules_block, Shown, LEDGER_HEADING, RULES_HEADING};

/// The words a client's own summary message opens with: Claude Code's, and
/// Codex's.
const HANDOFF_PREFIXES: [&str; 2] = [
    "This session is being continued from a previous conversation",
    "Another language model started to solve this problem",
];

/// The first line of the block the proxy appends.
pub const HANDOFF_NOTE: &str =
    "[compactor: from the conversation before this summary, what the summary does not state]";

/// Whether `text` is a client's own compaction hand-off (its summary of
/// the history it compacted): it opens with Claude Code's or Codex's
/// words, or holds Gemini CLI's whole `<state_snapshot>` (its asks for
/// one name the opening tag only).
pub fn is_handoff(text: &str) -> bool {
    let t = text.trim_start();
    HANDOFF_PREFIXES.iter().any(|p| t.starts_with(p))
        || (t.contains("<state_snapshot>") && t.contains("</state_snapshot>"))
}

/// The text a client carries over of `item`, an answer or the message
/// that carries it back: its text, trimmed; of a Gemini content, its text
/// parts that are no thoughts, joined as they are (how Gemini CLI takes
/// its summary from the answer to its compression).
pub fn carried_text(item: &Value) -> String {
    if !crate::wire::gemini::is_content(item) {
        return crate::compaction::items::text_of(item).trim().to_string();
    }
    let text: String = crate::wire::gemini::parts(item)
        .iter()
        .filter(|p| p.get("thought").and_then(Value::as_bool) != Some(true))
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect();
    text.trim().to_string()
}

/// What [`left_out`] is taken from: the facts of `history`, the items a
/// client's own compaction request carried, merged onto `carried` (the
/// trail a hand-off of the history before them kept, when the client
/// compacted it already: its items hold only its summary of it) the way a
/// compaction of the proxy's carries its base's facts forward.
pub fn trail_of(history: &[Value], carried: Option<&Facts>) -> Facts {
    extract_facts(history, carried)
}

/// The block to append to a client's hand-off `summary`: the rules, the
/// files changed and the commands of `all` (see [`trail_of`]) that
/// `summary` does not state; `None` when it states them all. A rule or a
/// file counts as stated when its text or path appears in the summary; a
/// command when its command line and its status both do.
pub fn left_out(all: &Facts, summary: &str) -> Option<String> {
    let said = |s: &str| summary.contains(s.trim());
    let facts = Facts {
        rules: all.rules.iter().filter(|r| !said(r)).cloned().collect(),
        rules_dropped: all.rules_dropped,
        files: all
            .files
            .iter()
            .filter(|f| f.action != "read" && !said(&f.path))
            .cloned()
            .collect(),
        files_dropped: all.files_dropped,
        commands: all
            .commands
            .iter()
            .filter(|c| !(said(&c.command) && said(&c.status)))
            .cloned()
            .collect(),
        commands_dropped: all.commands_dropped,
        ..Facts::default()
    };
    let label = |what: &str| format!("{FACTS_LABEL}: {what}");
    let shown = Shown::default();
    let blocks: Vec<String> = [
        (RULES_HEADING, rules_block(&facts, &shown, &label)),
        (LEDGER_HEADING, ledger_block(&facts, &shown, false, &label)),
    ]
    .into_iter()
    .filter_map(|(heading, block)| block.map(|b| format!("## {heading}\n{b}")))
    .collect();
    (!blocks.is_empty()).then(|| format!("{HANDOFF_NOTE}\n\n{}", blocks.join("\n\n")))
}

/// What of `item`, a user message, may be a summary a client carries
/// over: its whole text ([`carried_text`]), and each text part of a Gemini
/// content of several (Gemini CLI sends its session's context and the
/// summary it goes on from as two parts of one content).
pub fn carried_texts(item: &Value) -> Vec<String> {
    let mut out = vec![carried_text(item)];
    let parts = crate::wire::gemini::parts(item);
    if parts.len() > 1 {
        out.extend(
            parts
                .iter()
                .filter(|p| p.get("thought").and_then(Value::as_bool) != Some(true))
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(|t| t.trim().to_string()),
        );
    }
    out
}

/// `item` (a client's hand-off message) with `block` appended: to its text
/// when its content is a string, else as one more text part of the same
/// type as its text parts (`text`, or `input_text` on Responses; a part of
/// its own in a Gemini content's `parts`).
pub fn with_block(item: &Value, block: &str) -> Value {
    let mut out = item.clone();
    if let Some(Value::Array(parts)) = out.get_mut("parts") {
        parts.push(serde_json::json!({ "text": block }));
        return out;
    }
    match out.get_mut("content") {
        Some(Value::String(text)) => {
            text.push_str("\n\n");
            text.push_str(block);
        }
        Some(Value::Array(parts)) => {
            let kind = parts
                .iter()
                .filter_map(|p| p.get("type").and_then(Value::as_str))
                .find(|t| t.ends_with("text"))
                .unwrap_or("text")
                .to_string();
            parts.push(serde_json::json!({"type": kind, "text": block}));
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A Claude Code history: a rule, a file written, two commands.
    fn history() -> Vec<Value> {
        vec![
            json!({"role": "user", "content": "Fix the build."}),
            json!({"role": "assistant", "content": "I will start with the port."}),
            json!({"role": "user", "content": "From now on, never push to main."}),
            json!({"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "Write",
                 "input": {"file_path": "src/port.rs", "content": "pub const PORT: u16 = 8123;\n"}},
            ]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "File created successfully"},
            ]}),
            json!({"role": "assistant", "content": [
                {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "cargo test"}},
            ]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t2", "is_error": true,
                 "content": "Exit code 101\nerror[E0425]: cannot find value `PORT`"},
            ]}),
        ]
    }

    #[test]
    fn what_the_clients_summary_left_out_is_listed() {
        let summary = "This session is being continued from a previous conversation that ran out \
            of context. The user asked to fix the build.";
        assert!(is_handoff(summary));
        let block = left_out(&trail_of(&history(), None), summary).expect("something was left out");
        assert!(block.starts_with(HANDOFF_NOTE), "{block}");
        for fact in [
            "never push to main",
            "src/port.rs",
            "cargo test",
            "Exit code 101",
        ] {
            assert!(block.contains(fact), "{fact} in\n{block}");
        }
    }

    #[test]
    fn a_trail_carried_over_a_summary_keeps_each_fact_once() {
        let carried = trail_of(&history(), None);
        // After the client's summary: the rule said again, a new command.
        let after = vec![
            json!({"role": "user", "content": "From now on, never push to main."}),
            json!({"role": "assistant", "content": [
                {"type": "tool_use", "id": "t3", "name": "Bash", "input": {"command": "npm run lint"}},
            ]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t3", "is_error": true, "content": "Exit code 2"},
            ]}),
        ];
        let trail = trail_of(&after, Some(&carried));
        let block = left_out(&trail, "This session is being continued.").expect("left out");
        for (fact, times) in [
            ("never push to main", 1),
            ("src/port.rs", 1),
            ("cargo test", 1),
            ("npm run lint", 1),
            ("Exit code 2", 1),
        ] {
            assert_eq!(block.matches(fact).count(), times, "{fact} in\n{block}");
        }
    }

    #[test]
    fn what_the_summary_states_is_not_repeated() {
        let summary = "This session is being continued from a previous conversation. The user \
            said: From now on, never push to main. Wrote src/port.rs. Ran cargo test: Exit code 101";
        let block = left_out(&trail_of(&history(), None), summary);
        let listed = block.as_deref().unwrap_or("");
        for fact in ["never push to main", "src/port.rs", "cargo test"] {
            assert!(!listed.contains(fact), "{fact} repeated in\n{listed}");
        }
    }

    #[test]
    fn the_block_goes_after_the_hand_off_in_its_own_shape() {
        let text = json!({"role": "user", "content": "Summary."});
        assert_eq!(with_block(&text, "B")["content"], "Summary.\n\nB");
        let parts = json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Summary."}]});
        assert_eq!(
            with_block(&parts, "B")["content"][1],
            json!({"type": "input_text", "text": "B"})
        );
        let gemini = json!({"role": "user", "parts": [{"text": "<state_snapshot/>"}]});
        assert_eq!(
            with_block(&gemini, "B")["parts"],
            json!([{"text": "<state_snapshot/>"}, {"text": "B"}])
        );
    }

    #[test]
    fn gemini_clis_summary_is_what_its_answer_said_and_no_thought() {
        let answer = json!({"role": "model", "parts": [
            {"text": "Weighing what matters.", "thought": true},
            {"text": "\n<state_snapshot>\n  <goal>x</goal>"},
            {"text": "\n</state_snapshot>\n"},
        ]});
        let said = carried_text(&answer);
        assert_eq!(
            said,
            "<state_snapshot>\n  <goal>x</goal>\n</state_snapshot>"
        );
        assert_eq!(
            carried_text(&json!({"role": "user", "parts": [{"text": said}]})),
            said
        );
        assert!(is_handoff(&said));
        let opening =
            json!({"role": "user", "parts": [{"text": "<session_context/>"}, {"text": said}]});
        assert!(carried_texts(&opening).contains(&said));
    }

    #[test]
    fn only_a_clients_hand_off_is_one() {
        assert!(is_handoff(
            "  Another language model started to solve this problem and produced a summary"
        ));
        assert!(!is_handoff("Please continue from where we left off."));
        // Gemini CLI's asks for a snapshot are not one.
        assert!(!is_handoff(
            "Critically evaluate the <state_snapshot> you just generated."
        ));
    }
}
