//! A later summary goes after the earlier ones: a summary compaction over
//! a conversation an earlier summary compaction applies to keeps that
//! compaction's replacement (the leading items, the earlier summaries and
//! the user messages they kept) byte for byte where it was, and appends a
//! summary of what came after it. What the upstream has cached of the
//! conversation — tools, system and the compacted prefix — stays a cache
//! read on the request after the compaction, where a rewritten summary
//! would be written again from its first byte.
//!
//! The earlier summaries are read on every later request, so they are kept
//! only while they and the new one together stay within
//! [`super::Params::summaries_max_bytes`]; past it the next summary
//! compaction rewrites them all into one (the summary of [previous
//! summaries + newer items], as a first one over the raw history would
//! be): one deliberate rewrite, counted, after which appending starts over.
//!
//! The appended summary carries the facts of the items it covers: the
//! earlier ones are in the earlier summaries, which the request still
//! sends. The facts the compaction keeps for the next one (and audits the
//! request against) are all of them, merged, as for a rewrite.

use serde_json::Value;

use super::boundary;
use super::computed::{Compaction, Rung};
use super::items::{is_summary, text_of};
use super::params::Params;
use super::summary::{extract_facts, Facts};

/// What a summary compaction does with the earlier summaries in its view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Earlier {
    /// There are none (no base, or a base that is no summary of the
    /// proxy's): the summary is the first.
    None,
    /// Kept as sent: the view's first `kept` items (the base's
    /// replacement) stay, the new summary goes after them.
    Append {
        /// Items of the view kept verbatim.
        kept: usize,
    },
    /// They and the new one would pass the budget: rewritten into one.
    Rewrite {
        /// Bytes of the earlier summaries.
        bytes: usize,
        /// Their budget, bytes ([`Params::summaries_max_bytes`]).
        budget: usize,
    },
    /// Appending leaves no room within the compaction's limit (a hard
    /// limit, an overflow): rewritten into one, as past the budget.
    Crowded,
}

/// The task line of an appended summary: the task is the first summary's.
pub const CONTINUED_TASK: &str = "(stated in the summary above, which this one continues)";

/// What a summary compaction of `view` (the request as it goes upstream,
/// `base` applied) does with the summaries `base` left in it.
pub fn earlier(view: &[Value], base: Option<&Compaction>, params: &Params) -> Earlier {
    let Some(base) = base.filter(|b| matches!(b.rung, Rung::Summary | Rung::Fallback)) else {
        return Earlier::None;
    };
    let kept = base.replacement.len();
    // A provider's compaction block is the provider's window: not appended to.
    if kept > view.len() || boundary::floor(&base.replacement) > 0 {
        return Earlier::None;
    }
    let summaries: Vec<&Value> = view[..kept].iter().filter(|i| is_summary(i)).collect();
    if summaries.is_empty() {
        return Earlier::None;
    }
    let bytes: usize = summaries.iter().map(|s| text_of(s).len()).sum();
    if bytes + params.summary_max_bytes > params.summaries_max_bytes {
        return Earlier::Rewrite {
            bytes,
            budget: params.summaries_max_bytes,
        };
    }
    Earlier::Append { kept }
}

/// The facts an appended summary shows: those of `part` (the items it
/// covers), its task the first summary's.
pub fn appended_facts(part: &[Value]) -> Facts {
    let seed = Facts {
        task: Some(CONTINUED_TASK.to_string()),
        ..Facts::default()
    };
    extract_facts(part, Some(&seed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::items::user_message;
    use crate::compaction::items::SUMMARY_MARKER;
    use crate::config::{CompactionConfig, ModelLimits};
    use serde_json::json;

    fn params() -> Params {
        Params::new(
            &CompactionConfig::default(),
            &ModelLimits {
                context_window: 200_000,
                max_output_tokens: 32_000,
                trigger_ratio: 0.9,
                trigger_max_tokens: 85_000,
            },
        )
    }

    fn summary(bytes: usize) -> Value {
        user_message(format!(
            "{SUMMARY_MARKER} of 9 earlier items]\n{}",
            "x".repeat(bytes)
        ))
    }

    fn base(replacement: Vec<Value>, rung: Rung) -> Compaction {
        let mut c = crate::compaction::test_compaction("cmp_b", "t", 9, [1; 32], replacement);
        c.rung = rung;
        c
    }

    #[test]
    fn a_later_summary_appends_until_the_summaries_pass_their_budget() {
        let p = params();
        let system = json!({"role": "system", "content": "sys"});
        let kept_user = json!({"role": "user", "content": "keep going"});
        let tail = json!({"role": "assistant", "content": "on it"});
        let replacement = vec![system.clone(), summary(4_000), kept_user.clone()];
        let view: Vec<Value> = replacement.iter().cloned().chain([tail.clone()]).collect();
        let b = base(replacement, Rung::Summary);
        assert_eq!(earlier(&view, Some(&b), &p), Earlier::Append { kept: 3 });
        assert_eq!(earlier(&view, None, &p), Earlier::None);
        // A prune's replacement holds no summary to append to.
        let pruned = base(vec![system.clone(), kept_user.clone()], Rung::Prune);
        assert_eq!(earlier(&view[1..], Some(&pruned), &p), Earlier::None);
        // Two summaries that leave no room for a third: rewritten.
        let big = p.summaries_max_bytes - p.summary_max_bytes;
        let replacement = vec![system, summary(big / 2), kept_user, summary(big / 2)];
        let view: Vec<Value> = replacement.iter().cloned().chain([tail]).collect();
        let b = base(replacement, Rung::Fallback);
        assert!(
            matches!(earlier(&view, Some(&b), &p), Earlier::Rewrite { bytes, .. } if bytes > big),
            "{:?}",
            earlier(&view, Some(&b), &p)
        );
    }

    #[test]
    fn an_appended_summary_shows_its_own_facts_and_points_to_the_task() {
        let part = vec![
            json!({"role": "user", "content": "From now on, never touch the lockfile."}),
            json!({"role": "assistant", "content": "Decision: pin serde because the build broke."}),
        ];
        let f = appended_facts(&part);
        assert_eq!(f.task.as_deref(), Some(CONTINUED_TASK));
        assert_eq!(f.rules, ["From now on, never touch the lockfile."]);
        assert!(!f.decisions.is_empty(), "{f:?}");
    }
}
