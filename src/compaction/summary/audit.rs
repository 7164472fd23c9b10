//! The audit of one compaction: its facts checklist (each fact the proxy
//! extracted from the compacted part, and whether the compacted request
//! still holds it), the facts repaired into it before it was used, those
//! it forgot, and what it removed (item refs).
//!
//! Pure: the engine computes the checklist against the text of the request
//! the compaction makes (the replacement and the tail sent after it),
//! asks [`repair_block`] for the text restoring the absent facts that fit,
//! and records the outcome with [`Audit::new`]. Forgetting is an event: a
//! fact that cannot fit the request's limit is recorded, never an error.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checklist::{checklist, Check, FactKind};
use super::facts::Facts;
use super::labels::FACTS_LABEL;
use super::text::{clip, fenced};
use crate::compaction::items::{is_summary, text_of, user_message, FACTS_MESSAGE};

/// Longest fact text an audit keeps (longer ones are clipped with `…`):
/// a failure block is at most 1,000 bytes, a task can be any size.
pub const MAX_FACT_BYTES: usize = 600;

/// Most facts an audit keeps (the extracted facts are bounded already:
/// this bounds a stored audit whatever they hold).
pub const MAX_AUDIT_FACTS: usize = 200;

/// Most removed item refs an audit lists (how many were removed is always
/// stated).
pub const MAX_REMOVED_REFS: usize = 1000;

/// What became of one fact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FactState {
    /// In the compacted request as it was computed.
    Present,
    /// Absent from it, and added to its facts message before it was used.
    Repaired,
    /// Absent, and no room within the request's limit to add it.
    Forgotten,
}

impl FactState {
    /// The label in metrics and views: `kept`, `repaired`, `forgotten`.
    pub fn as_str(self) -> &'static str {
        match self {
            FactState::Present => "kept",
            FactState::Repaired => "repaired",
            FactState::Forgotten => "forgotten",
        }
    }
}

impl FactKind {
    /// The label in metrics and views.
    pub fn as_str(self) -> &'static str {
        match self {
            FactKind::Task => "task",
            FactKind::File => "file",
            FactKind::Failure => "failure",
            FactKind::Decision => "decision",
            FactKind::Constraint => "constraint",
            FactKind::NextStep => "next_step",
            FactKind::Command => "command",
            FactKind::Rule => "rule",
            FactKind::System => "system",
        }
    }

    /// Every kind, in the order a checklist lists them.
    pub const ALL: [FactKind; 9] = [
        FactKind::Task,
        FactKind::File,
        FactKind::Failure,
        FactKind::Decision,
        FactKind::Constraint,
        FactKind::NextStep,
        FactKind::Command,
        FactKind::Rule,
        FactKind::System,
    ];

    /// Which kind is repaired first when room is short: the reverse of the
    /// order the facts give way in (constraints, decisions, commands,
    /// system messages, files, errors, next step, rules, the task last).
    pub fn keep_rank(self) -> u8 {
        match self {
            FactKind::Task => 0,
            FactKind::Rule => 1,
            FactKind::NextStep => 2,
            FactKind::Failure => 3,
            FactKind::File => 4,
            FactKind::System => 5,
            FactKind::Command => 6,
            FactKind::Decision => 7,
            FactKind::Constraint => 8,
        }
    }
}

/// One line of a stored checklist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditedFact {
    /// What the fact is.
    pub kind: FactKind,
    /// The fact as extracted, clipped to [`MAX_FACT_BYTES`].
    pub fact: String,
    /// Present, repaired or forgotten.
    pub state: FactState,
}

/// A compaction's audit, stored with it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// The checklist, in the order [`super::checklist`] gives it.
    pub facts: Vec<AuditedFact>,
    /// Refs (`item:<first 16 hex of the item hash>`, as recall and export
    /// name them) of the items of the request it replaced that it does not
    /// send as they were: summarized, truncated or pruned. At most
    /// [`MAX_REMOVED_REFS`], the oldest first.
    pub removed: Vec<String>,
    /// How many items it removed (`removed` may list fewer).
    pub removed_count: usize,
}

impl Audit {
    /// The audit of a compaction whose request was first checked as
    /// `before` and, after the repair, as `after` (both of the same facts),
    /// having removed the items `removed` names.
    pub fn new(before: &[Check], after: &[Check], removed: Vec<String>) -> Audit {
        let facts = before
            .iter()
            .zip(after)
            .take(MAX_AUDIT_FACTS)
            .map(|(b, a)| AuditedFact {
                kind: b.kind,
                fact: clip(&b.fact, MAX_FACT_BYTES),
                state: match (b.present, a.present) {
                    (true, _) => FactState::Present,
                    (false, true) => FactState::Repaired,
                    (false, false) => FactState::Forgotten,
                },
            })
            .collect();
        let removed_count = removed.len();
        let mut removed = removed;
        removed.truncate(MAX_REMOVED_REFS);
        Audit {
            facts,
            removed,
            removed_count,
        }
    }

    /// The facts it forgot.
    pub fn forgotten(&self) -> impl Iterator<Item = &AuditedFact> {
        self.facts
            .iter()
            .filter(|f| f.state == FactState::Forgotten)
    }

    /// How many facts of `kind` ended in `state`.
    pub fn count(&self, kind: FactKind, state: FactState) -> u64 {
        self.facts
            .iter()
            .filter(|f| f.kind == kind && f.state == state)
            .count() as u64
    }
}

/// The facts of `checks` absent from the request, the first to repair
/// first (the task, next steps, failures, files, decisions, constraints;
/// within a kind, the newest first, as the summary keeps them).
pub fn to_repair(checks: &[Check]) -> Vec<&Check> {
    let mut missing: Vec<(usize, &Check)> = checks
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.present)
        .collect();
    missing.sort_by_key(|&(i, c)| (c.kind.keep_rank(), std::cmp::Reverse(i)));
    missing.into_iter().map(|(_, c)| c).collect()
}

/// The block restoring `facts` to a facts message, each verbatim (a
/// failure in a fence, as the summary quotes it); `None` when there are
/// none.
pub fn repair_block(facts: &[&Check]) -> Option<String> {
    if facts.is_empty() {
        return None;
    }
    let mut s = repair_header();
    for f in facts {
        s.push_str(&repair_line(f));
    }
    Some(s)
}

/// The heading of a repair block.
fn repair_header() -> String {
    format!(
        "## FACTS RESTORED\n{FACTS_LABEL}: facts of the compacted items the rest of this message does not hold"
    )
}

/// One restored fact of a repair block.
fn repair_line(f: &Check) -> String {
    let label = match f.kind {
        FactKind::Task => "task",
        FactKind::File => "changed file",
        FactKind::Failure => "failure",
        FactKind::Decision => "decision",
        FactKind::Constraint => "the user's request",
        FactKind::NextStep => "next step",
        FactKind::Command => "command",
        FactKind::Rule => "the user's standing rule",
        FactKind::System => "system message",
    };
    if f.kind == FactKind::Failure || f.fact.contains('\n') {
        format!("\n- {label}:\n{}", fenced(&f.fact, "text"))
    } else {
        format!("\n- {label}: {}", f.fact)
    }
}

/// The text a checklist is checked against: every string of `items`,
/// decoded, one per line; a string that holds JSON (tool-call arguments)
/// is read as well, so a path written with escapes is found as it is.
pub fn sent_text<'a>(items: impl IntoIterator<Item = &'a Value>) -> String {
    fn walk(v: &Value, depth: usize, out: &mut String) {
        match v {
            Value::String(s) => {
                out.push_str(s);
                out.push('\n');
                let t = s.trim_start();
                if depth > 0 && (t.starts_with('{') || t.starts_with('[')) {
                    if let Ok(inner) = serde_json::from_str::<Value>(s) {
                        walk(&inner, depth - 1, out);
                    }
                }
            }
            Value::Array(a) if depth > 0 => a.iter().for_each(|x| walk(x, depth - 1, out)),
            Value::Object(o) if depth > 0 => o.values().for_each(|x| walk(x, depth - 1, out)),
            _ => {}
        }
    }
    let mut out = String::new();
    for item in items {
        walk(item, 8, &mut out);
    }
    out
}

/// A compaction's request after its audit: repaired if it had to be.
#[derive(Debug, Clone)]
pub struct Audited {
    /// The replacement, with the facts restored (into its summary message,
    /// or, for a rung without one, a facts message after its leading items).
    pub replacement: Vec<Value>,
    /// Tokens of the request after (items only), the repair included.
    pub after: u64,
    /// The summary message's text, when the repair changed it.
    pub summary: Option<String>,
    /// Its audit.
    pub audit: Audit,
}

/// Checks `facts` against the request a compaction makes (`replacement`,
/// then the `tail` sent verbatim after it; `after` its tokens) and restores
/// the absent facts that fit under `ceiling` tokens, the first to keep
/// first ([`to_repair`]); the rest are recorded as forgotten. `removed`
/// names the items it removed. With `written`, the compaction wrote the
/// replacement's last summary message, which takes the restored facts;
/// else (a cheap rung, whose replacement may hold an earlier compaction's
/// summary, kept as the upstream cached it) they go in a message of their
/// own at the replacement's end.
#[allow(clippy::too_many_arguments)]
pub fn audit_and_repair(
    facts: &Facts,
    replacement: Vec<Value>,
    tail: &[Value],
    after: u64,
    ceiling: u64,
    removed: Vec<String>,
    count: &dyn Fn(&Value) -> u64,
    written: bool,
) -> Audited {
    let checks = checklist(facts, &sent_text(replacement.iter().chain(tail)));
    let missing = to_repair(&checks);
    if missing.is_empty() {
        return Audited {
            audit: Audit::new(&checks, &checks, removed),
            replacement,
            after,
            summary: None,
        };
    }
    // The facts message: the summary's, or a new one at the end of the
    // replacement (one whole tag block, so a later compaction does not take
    // it for the task or for the user's requests). At the end, because what
    // precedes it is what the upstream has cached: a cheap rung leaves the
    // items before its first rewritten output as they were sent, and a
    // later one keeps the earlier facts message where it was, so each
    // repair changes the cached prefix no earlier than the rung itself.
    let at = replacement.iter().rposition(is_summary).filter(|_| written);
    let old_tokens = at.map(|i| count(&replacement[i])).unwrap_or(0);
    let message = |block: &str| match at {
        Some(i) => user_message(format!("{}\n\n{block}", text_of(&replacement[i]))),
        None => user_message(format!("{FACTS_MESSAGE}\n{block}\n</compactor_facts>")),
    };
    let tokens_with = |chosen: &[&Check]| -> Option<(Value, u64)> {
        let block = repair_block(chosen)?;
        let m = message(&block);
        let t = after - old_tokens.min(after) + count(&m);
        Some((m, t))
    };
    // Each fact is tried on its own estimate (the tokens its line adds to
    // the message), the chosen ones counted whole once; over the ceiling,
    // the last chosen give way until the message fits.
    let header = repair_header();
    let empty = count(&message(&header));
    let alone = count(&user_message(header.clone()));
    let mut chosen: Vec<&Check> = Vec::new();
    let mut estimate = (after - old_tokens.min(after)) + empty;
    for m in missing {
        let t = count(&user_message(format!("{header}{}", repair_line(m)))).saturating_sub(alone);
        if estimate + t <= ceiling {
            estimate += t;
            chosen.push(m);
        }
    }
    let mut fitted = None;
    while !chosen.is_empty() {
        match tokens_with(&chosen) {
            Some((m, t)) if t <= ceiling => {
                fitted = Some((m, t));
                break;
            }
            _ => {
                chosen.pop();
            }
        }
    }
    let Some((m, t)) = fitted else {
        return Audited {
            audit: Audit::new(&checks, &checks, removed),
            replacement,
            after,
            summary: None,
        };
    };
    let mut replacement = replacement;
    let summary = at.map(|_| text_of(&m));
    match at {
        Some(i) => replacement[i] = m,
        None => replacement.push(m),
    }
    let repaired = checklist(facts, &sent_text(replacement.iter().chain(tail)));
    Audited {
        audit: Audit::new(&checks, &repaired, removed),
        replacement,
        after: t,
        summary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::summary::testing::*;
    use serde_json::json;

    #[test]
    fn a_repair_block_restores_every_absent_fact_verbatim() {
        let mut f = sample_facts();
        f.decisions = vec!["Decision: max_age 3600 because sessions last an hour".into()];
        f.next_steps = vec!["Next step: rerun pytest -k cookie".into()];
        let before = checklist(&f, "nothing here");
        assert!(before.iter().all(|c| !c.present), "{before:?}");
        let order: Vec<FactKind> = to_repair(&before).iter().map(|c| c.kind).collect();
        assert_eq!(
            order,
            [
                FactKind::Task,
                FactKind::NextStep,
                FactKind::Failure,
                FactKind::File,
                FactKind::Command,
                FactKind::Decision
            ]
        );
        let block = repair_block(&to_repair(&before)).unwrap();
        let after = checklist(&f, &block);
        assert!(after.iter().all(|c| c.present), "{block}");
        let audit = Audit::new(&before, &after, vec!["item:00".into()]);
        assert!(audit.facts.iter().all(|a| a.state == FactState::Repaired));
        assert_eq!(audit.count(FactKind::Failure, FactState::Repaired), 1);
        assert_eq!(audit.removed_count, 1);
        assert!(repair_block(&[]).is_none());
    }

    #[test]
    fn an_audit_bounds_what_it_keeps_and_names_the_forgotten() {
        let checks = vec![
            Check {
                kind: FactKind::Task,
                fact: "t".repeat(5000),
                present: true,
            },
            Check {
                kind: FactKind::Constraint,
                fact: "Never change the cookie name.".into(),
                present: false,
            },
        ];
        let refs: Vec<String> = (0..MAX_REMOVED_REFS + 5)
            .map(|i| format!("item:{i}"))
            .collect();
        let a = Audit::new(&checks, &checks, refs);
        assert!(a.facts[0].fact.len() <= MAX_FACT_BYTES);
        assert_eq!(a.facts[0].state, FactState::Present);
        let gone: Vec<&str> = a.forgotten().map(|f| f.fact.as_str()).collect();
        assert_eq!(gone, ["Never change the cookie name."]);
        assert_eq!(a.removed.len(), MAX_REMOVED_REFS);
        assert_eq!(a.removed_count, MAX_REMOVED_REFS + 5);
        // It round-trips as stored.
        let back: Audit = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back, a);
    }

    /// Tokens as a quarter of the item's JSON bytes.
    fn quarter(v: &Value) -> u64 {
        v.to_string().len() as u64 / 4
    }

    /// Within a ceiling, the first to keep are restored first and the rest
    /// are recorded forgotten; with no summary message, the facts message
    /// goes after the leading system items, where no later compaction takes
    /// it for the task.
    #[test]
    fn a_repair_restores_the_first_to_keep_within_the_ceiling() {
        let mut f = sample_facts();
        f.constraints = vec!["Never change the cookie name.".into()];
        f.next_steps = vec!["Next step: rerun pytest -k cookie".into()];
        let replacement = vec![
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "assistant", "content": "ok"}),
        ];
        let tail = [json!({"role": "user", "content": "go on"})];
        let after: u64 = replacement.iter().chain(&tail).map(quarter).sum();
        // Room for everything.
        let all = audit_and_repair(
            &f,
            replacement.clone(),
            &tail,
            after,
            u64::MAX,
            vec![],
            &quarter,
            true,
        );
        assert!(
            all.audit
                .facts
                .iter()
                .all(|a| a.state == FactState::Repaired),
            "{:?}",
            all.audit
        );
        assert_eq!(all.replacement.len(), 3);
        assert_eq!(all.replacement[..2], replacement[..], "after them");
        let facts_message = text_of(&all.replacement[2]);
        assert!(facts_message.starts_with("<compactor_facts>"));
        assert!(super::super::is_injected(&facts_message));
        assert_eq!(
            all.after,
            all.replacement
                .iter()
                .chain(&tail)
                .map(quarter)
                .sum::<u64>()
        );
        // Room for the task and the next step only.
        let some = Check {
            kind: FactKind::Task,
            fact: f.task.clone().unwrap(),
            present: false,
        };
        let next = Check {
            kind: FactKind::NextStep,
            fact: f.next_steps[0].clone(),
            present: false,
        };
        let room = quarter(&user_message(format!(
            "<compactor_facts>\n{}\n</compactor_facts>",
            repair_block(&[&some, &next]).unwrap()
        )));
        let tight = audit_and_repair(
            &f,
            replacement.clone(),
            &tail,
            after,
            after + room,
            vec![],
            &quarter,
            true,
        );
        assert!(tight.after <= after + room);
        let state = |k: FactKind| {
            tight
                .audit
                .facts
                .iter()
                .find(|a| a.kind == k)
                .map(|a| a.state)
        };
        assert_eq!(state(FactKind::Task), Some(FactState::Repaired));
        assert_eq!(state(FactKind::NextStep), Some(FactState::Repaired));
        assert_eq!(state(FactKind::Constraint), Some(FactState::Forgotten));
        // No room at all: nothing changes, everything absent is forgotten.
        let none = audit_and_repair(
            &f,
            replacement.clone(),
            &tail,
            after,
            after,
            vec![],
            &quarter,
            true,
        );
        assert_eq!(none.replacement, replacement);
        assert!(none
            .audit
            .facts
            .iter()
            .all(|a| a.state == FactState::Forgotten));
        // A summary message takes the restored facts itself.
        let mut with_summary = replacement.clone();
        with_summary.insert(
            1,
            user_message("[compactor summary of 3 earlier items]\n## TASK\n".into()),
        );
        let repair = |written: bool| {
            let r = with_summary.clone();
            audit_and_repair(&f, r, &tail, after, u64::MAX, vec![], &quarter, written)
        };
        let s = repair(true);
        assert_eq!(s.replacement.len(), 3);
        let text = s.summary.expect("the summary changed");
        assert!(
            text.contains("## FACTS RESTORED") && text.contains("KeyError: 'session'"),
            "{text}"
        );
        // An earlier compaction's summary a cheap rung keeps stays as the
        // upstream cached it: the facts go after it, at the end.
        let s = repair(false);
        assert_eq!(s.summary, None);
        assert_eq!(s.replacement[..3], with_summary[..]);
        assert!(text_of(&s.replacement[3]).starts_with(FACTS_MESSAGE));
    }

    #[test]
    fn sent_text_reads_strings_inside_arguments() {
        let items =
            [json!({"type": "function_call", "arguments": "{\"path\":\"src/caf\\u00e9.rs\"}"})];
        assert!(sent_text(&items).contains("src/café.rs"));
    }
}
