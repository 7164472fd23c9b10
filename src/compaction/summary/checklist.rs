//! The facts checklist of a compaction: every fact the proxy extracted —
//! the task, each changed file, each failure, each decision, constraint
//! and next step — and whether it is present, verbatim, in the compacted
//! request. What is absent is what the compaction forgot: over budget the
//! facts give way lowest-first, and the checklist says which did.

use serde::{Deserialize, Serialize};

use super::facts::Facts;

/// What a checked fact is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FactKind {
    /// The task, verbatim.
    Task,
    /// A changed file, by its path.
    File,
    /// A failure's quoted block.
    Failure,
    /// One of the assistant's decisions.
    Decision,
    /// One of the user's constraints.
    Constraint,
    /// One of the assistant's next steps.
    NextStep,
    /// A command the ledger records, with how it ended (its line).
    Command,
    /// One of the user's standing rules.
    Rule,
    /// A system message inside the conversation, verbatim.
    System,
}

/// One line of the checklist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// What the fact is.
    pub kind: FactKind,
    /// The fact as extracted (a file by its path).
    pub fact: String,
    /// Whether `fact` is in the compacted request verbatim.
    pub present: bool,
}

/// The checklist of `facts` against `sent`, the text of the compacted
/// request's items (every string of them, decoded, in any order): the
/// task, then changed files, failures, decisions, constraints, next
/// steps, the ledger's commands, the user's standing rules and the system
/// messages, in the order the facts hold them.
pub fn checklist(facts: &Facts, sent: &str) -> Vec<Check> {
    let check = |kind, fact: &str| Check {
        kind,
        fact: fact.to_string(),
        present: sent.contains(fact),
    };
    let mut out = Vec::new();
    if let Some(t) = &facts.task {
        out.push(check(FactKind::Task, t));
    }
    out.extend(
        facts
            .files
            .iter()
            .filter(|f| f.action != "read")
            .map(|f| check(FactKind::File, &f.path)),
    );
    out.extend(facts.errors.iter().map(|e| check(FactKind::Failure, e)));
    out.extend(facts.decisions.iter().map(|s| check(FactKind::Decision, s)));
    out.extend(
        facts
            .constraints
            .iter()
            .map(|s| check(FactKind::Constraint, s)),
    );
    out.extend(
        facts
            .next_steps
            .iter()
            .map(|s| check(FactKind::NextStep, s)),
    );
    out.extend(
        facts
            .commands
            .iter()
            .map(|c| check(FactKind::Command, &c.line())),
    );
    out.extend(facts.rules.iter().map(|s| check(FactKind::Rule, s)));
    out.extend(facts.system.iter().map(|s| check(FactKind::System, s)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;

    /// A summary cut to a tight budget forgets the lowest facts first, and
    /// the checklist names exactly those.
    #[test]
    fn the_checklist_names_what_a_tight_summary_forgot() {
        let mut f = sample_facts();
        // A task that names no path: the file must be present on its own.
        f.task = Some("Fix the expired cookie bug; keep the API unchanged.".into());
        f.decisions = vec!["Decision: max_age 3600 because sessions last an hour".into()];
        f.constraints = vec!["Never change the cookie name.".into()];
        f.next_steps = vec!["Next step: rerun pytest -k cookie".into()];
        f.rules = vec!["From now on, run pytest before every commit.".into()];
        f.system = vec!["<system-reminder>\nDeferred tools: WebFetch\n</system-reminder>".into()];
        let whole = assemble(&f, None, 9, usize::MAX);
        let all = checklist(&f, &whole);
        assert_eq!(all.len(), 9, "{all:?}");
        assert!(all.iter().all(|c| c.present), "{all:?}");
        let floor = assemble(&f, None, 9, 0).len();
        let mut forgotten_at = Vec::new();
        for max in (floor..whole.len()).rev() {
            let s = assemble(&f, None, 9, max);
            let gone: Vec<FactKind> = checklist(&f, &s)
                .into_iter()
                .filter(|c| !c.present)
                .map(|c| c.kind)
                .collect();
            if forgotten_at.last() != Some(&gone) {
                forgotten_at.push(gone);
            }
        }
        // Each step forgets one more, in the order they give way; the task stays.
        let order: Vec<FactKind> = forgotten_at
            .windows(2)
            .filter_map(|w| w[1].iter().find(|k| !w[0].contains(k)).copied())
            .collect();
        assert_eq!(
            order,
            [
                FactKind::Constraint,
                FactKind::Decision,
                FactKind::Command,
                FactKind::System,
                FactKind::File,
                FactKind::Failure,
                FactKind::NextStep,
                FactKind::Rule,
            ],
            "{forgotten_at:?}"
        );
    }
}
