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
    fn statements_are_deduplicated_and_capped() {
        let mut l = Vec::new();
        for i in 0..20 {
            push_statement(&mut l, format!("s{}", i % 15));
        }
        assert_eq!(l.len(), MAX_STATEMENTS);
        assert_eq!(l.last().unwrap(), "s4");
    }
}
