//! Short statements worth keeping verbatim: the agent's own decisions
//! ("Decision: … because …") and next steps ("Next step: …"), and the
//! constraints and preferences a user states after the task ("never …",
//! "don't …"). Summarizers often drop them; the proxy records them as facts.

use super::text::clip;

/// Longest statement kept (longer ones are clipped with `…`).
const MAX_STATEMENT: usize = 300;
/// Most statements kept per kind (newest kept).
pub(super) const MAX_STATEMENTS: usize = 12;

/// What a statement is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Statement {
    Decision,
    NextStep,
}

/// The line without its list marker or emphasis (`- **Decision:** x` →
/// `Decision: x`).
fn bare(line: &str) -> String {
    let t = line.trim();
    let t = t
        .strip_prefix("- ")
        .or_else(|| t.strip_prefix("* "))
        .or_else(|| t.strip_prefix("> "))
        .unwrap_or(t);
    t.replace("**", "").replace("__", "").trim().to_string()
}

fn starts_with_any(lower: &str, prefixes: &[&str]) -> bool {
    prefixes.iter().any(|p| lower.starts_with(p))
}

/// A line of the assistant's own text that states a decision or the next
/// step, as kept (verbatim, clipped).
pub(super) fn classify_assistant_line(line: &str) -> Option<(Statement, String)> {
    let t = bare(line);
    if t.is_empty() || t.len() > MAX_STATEMENT * 2 {
        return None;
    }
    let lower = t.to_lowercase();
    const DECISION: [&str; 8] = [
        "decision:",
        "decided",
        "we decided",
        "i decided",
        "i chose",
        "we chose",
        "going with",
        "chose ",
    ];
    const NEXT: [&str; 7] = [
        "next step",
        "next:",
        "next,",
        "next i",
        "then i",
        "plan:",
        "todo:",
    ];
    let kind = if starts_with_any(&lower, &DECISION) || lower.contains(" because ") {
        Statement::Decision
    } else if starts_with_any(&lower, &NEXT) {
        Statement::NextStep
    } else {
        return None;
    };
    Some((kind, clip(&t, MAX_STATEMENT)))
}

/// Lines of a user message (after the task) that state a standing rule
/// (`true`, [`is_standing_rule`]) or another constraint or preference.
pub(super) fn user_statements(text: &str) -> Vec<(bool, String)> {
    text.lines()
        .map(bare)
        .filter(|t| !t.is_empty() && t.len() <= MAX_STATEMENT * 2)
        .filter_map(|t| {
            let rule = is_standing_rule(&t);
            (rule || !user_constraints(&t).is_empty()).then(|| (rule, clip(&t, MAX_STATEMENT)))
        })
        .collect()
}

/// Lines of a user message (after the task) that state a constraint or a
/// preference.
pub(super) fn user_constraints(text: &str) -> Vec<String> {
    const MARKERS: [&str; 14] = [
        "never ",
        "always ",
        "don't ",
        "do not ",
        "must ",
        "mustn't",
        "should ",
        "shouldn't",
        "avoid ",
        "prefer",
        "constraint",
        "only ",
        "without ",
        "no new ",
    ];
    text.lines()
        .map(bare)
        .filter(|t| !t.is_empty() && t.len() <= MAX_STATEMENT * 2)
        .filter(|t| {
            let lower = format!(" {}", t.to_lowercase());
            MARKERS.iter().any(|m| lower.contains(&format!(" {m}")))
        })
        .map(|t| clip(&t, MAX_STATEMENT))
        .collect()
}

/// Whether a line the user wrote (one of [`user_constraints`], or any)
/// is a standing instruction: it holds from now on, not only for the
/// next step ("from now on…", "never…", "always…", "don't touch…", "use X
/// not Y").
pub(super) fn is_standing_rule(line: &str) -> bool {
    let lower = format!(" {}", line.to_lowercase().replace('’', "'"));
    const MARKERS: [&str; 12] = [
        " from now on",
        " going forward",
        " from here on",
        " never ",
        " always ",
        " don't ",
        " do not ",
        " dont ",
        " no more ",
        " stop ",
        " must not ",
        " mustn't ",
    ];
    let use_not = lower.contains(" use ")
        && [" not ", " instead of ", " rather than ", ", not "]
            .iter()
            .any(|m| lower.contains(m));
    use_not || MARKERS.iter().any(|m| lower.contains(m))
}

/// Whether a decision reverses an earlier one ("instead", "revert",
/// "switching back", "changed my mind", …).
pub(super) fn reverses(decision: &str) -> bool {
    let lower = decision.to_lowercase();
    const MARKERS: [&str; 14] = [
        "instead",
        "revert",
        "switch back",
        "switching back",
        "changed my mind",
        "scratch that",
        "no longer",
        "reverse",
        "rather than",
        "go back to",
        "going back to",
        "on second thought",
        "replaces the earlier",
        "supersede",
    ];
    MARKERS.iter().any(|m| lower.contains(m))
}

/// Appends `s` to a pinned list kept verbatim and in order: once (a
/// repeat keeps its first place), the oldest dropped past `max` and
/// counted in `dropped`.
pub(super) fn push_pinned(list: &mut Vec<String>, dropped: &mut usize, s: String, max: usize) {
    if list.contains(&s) {
        return;
    }
    list.push(s);
    if list.len() > max {
        let n = list.len() - max;
        list.drain(..n);
        *dropped += n;
    }
}

/// The context blocks a harness puts inside the history as user text
/// (Claude Code's `<system-reminder>`, Codex's `<environment_context>`):
/// each block verbatim, clipped to `max` bytes; at most
/// [`MAX_BLOCKS`] of each tag, the last ones.
pub(super) fn system_blocks(text: &str, max: usize) -> Vec<String> {
    const TAGS: [&str; 2] = ["system-reminder", "environment_context"];
    let mut out = Vec::new();
    for tag in TAGS {
        let (open, close) = (format!("<{tag}"), format!("</{tag}>"));
        let mut rest = text;
        let mut blocks = Vec::new();
        while let Some(i) = rest.find(&open) {
            let after = &rest[i..];
            // An unclosed block runs to the end: nothing follows it.
            let Some(end) = after.find(&close).map(|e| e + close.len()) else {
                blocks.push(after);
                break;
            };
            blocks.push(&after[..end]);
            rest = &after[end..];
        }
        let from = blocks.len().saturating_sub(MAX_BLOCKS);
        out.extend(blocks[from..].iter().map(|b| clip(b.trim(), max)));
    }
    out
}

/// Most context blocks of one tag read from one text.
const MAX_BLOCKS: usize = 16;

/// Appends `s` to `list` (moved to the end when already there), newest
/// [`MAX_STATEMENTS`] kept.
pub(super) fn push_statement(list: &mut Vec<String>, s: String) {
    list.retain(|x| *x != s);
    list.push(s);
    if list.len() > MAX_STATEMENTS {
        list.drain(..list.len() - MAX_STATEMENTS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_and_next_steps_are_recognised() {
        assert_eq!(
            classify_assistant_line("- **Decision:** use chrono because offsets break the parser"),
            Some((
                Statement::Decision,
                "Decision: use chrono because offsets break the parser".into()
            ))
        );
        assert_eq!(
            classify_assistant_line("Next step: rerun the iso suite."),
            Some((
                Statement::NextStep,
                "Next step: rerun the iso suite.".into()
            ))
        );
        assert_eq!(
            classify_assistant_line("I kept it simple because the API is frozen.").map(|s| s.0),
            Some(Statement::Decision)
        );
        for plain in ["Let me read the file.", "", "The next function is long."] {
            assert_eq!(classify_assistant_line(plain), None, "{plain}");
        }
    }

    #[test]
    fn user_constraints_are_the_lines_that_state_one() {
        assert_eq!(
            user_constraints("Looks good.\nPlease never rename the legacy table.\nDon't add deps"),
            vec![
                "Please never rename the legacy table.".to_string(),
                "Don't add deps".to_string()
            ]
        );
        assert!(user_constraints("Keep going.").is_empty());
    }

    #[test]
    fn standing_rules_and_reversals() {
        for rule in [
            "From now on, run clippy before every commit.",
            "Never push to main.",
            "Always use tabs in the Makefile.",
            "Please don't touch the billing_archive schema.",
            "Use pnpm, not npm.",
            "use ruff instead of flake8",
        ] {
            assert!(is_standing_rule(rule), "{rule}");
        }
        for not in ["Keep going.", "Only the tests for now", "Looks good"] {
            assert!(!is_standing_rule(not), "{not}");
        }
        assert!(reverses(
            "Decision: go back to SQLite instead of Postgres because the CI has no server."
        ));
        assert!(!reverses(
            "Decision: use Postgres because we need row locks."
        ));
    }

    #[test]
    fn system_blocks_are_kept_verbatim() {
        let t = "<system-reminder>\nDeferred tools: WebFetch, NotebookEdit\n</system-reminder>\nFix it\n<environment_context>\n<cwd>/repo/api</cwd>\n</environment_context>";
        assert_eq!(
            system_blocks(t, 1000),
            vec![
                "<system-reminder>\nDeferred tools: WebFetch, NotebookEdit\n</system-reminder>"
                    .to_string(),
                "<environment_context>\n<cwd>/repo/api</cwd>\n</environment_context>".to_string(),
            ]
        );
        let mut l = Vec::new();
        let mut dropped = 0;
        for i in [0, 1, 2, 1, 3, 2] {
            push_pinned(&mut l, &mut dropped, format!("r{i}"), 3);
        }
        assert_eq!(
            (l, dropped),
            (vec!["r1".into(), "r2".into(), "r3".into()], 1)
        );
    }

    #[test]
    fn statements_are_deduplicated_and_capped() {
        let mut l = Vec::new();
        for i in 0..20 {
            push_statement(&mut l, format!("s{}", i % 15));
        }
        assert_eq!(l.len(), MAX_STATEMENTS);
        assert_eq!(l.last().unwrap(), "s4");
    }
}
