//! Fitting a request under a limit: the escalation past the ladder, decided
//! from token counts alone, before any summarizer call is paid for.
//!
//! The steps, each tried only when the one before does not fit:
//!
//! 1. the ladder's own cut (verbatim tail within its budget);
//! 2. later safe cuts, down to the smallest safe tail (inside the current
//!    turn: the newest user message or the pending tool batch);
//! 3. that tail's oversized tool outputs truncated, harder and harder (head
//!    and tail kept, the original archived, a marker);
//! 4. fewer of the older user messages kept verbatim;
//! 5. the irreducible core: leading system/developer items, the summary at
//!    its smallest, the newest user message and the pending tool batch.
//!
//! When even the core is over the limit nothing can fit and no compaction
//! is attempted ([`CannotFit`]).

use serde_json::Value;

use super::computed::Compaction;
use super::items::{self, latest_user, leading_system};
use super::ladder::{self, TruncateLimits};
use super::params::Params;
use super::prepare::Prepared;
use super::rungs::summary_replacement;
use super::{cut, rewrite, summary};
use crate::wire::ItemHash;

/// The step of the escalation a plan reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    /// The ladder's cut fits.
    Ladder,
    /// A later safe cut.
    LaterCut,
    /// The smallest tail, its tool outputs truncated.
    TruncateTail,
    /// Fewer older user messages.
    FewerUsers,
}

impl Step {
    /// Name used in reasons and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Ladder => "ladder",
            Step::LaterCut => "later_cut",
            Step::TruncateTail => "truncate_tail",
            Step::FewerUsers => "fewer_users",
        }
    }
}

/// Where to cut and what to keep so that the request fits.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The cut: `view[lead..cut]` is summarized.
    pub prepared: Prepared,
    /// Token budget of the older user messages kept verbatim.
    pub user_budget: u64,
    /// The tail's tool outputs are truncated with these limits (and the
    /// tail then belongs to the replacement).
    pub tail_truncate: Option<TruncateLimits>,
    /// Tokens the summary message may take.
    pub summary_budget: u64,
    /// The step reached.
    pub step: Step,
}

/// Nothing fits: the irreducible core alone is over the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot fit: the irreducible core is {core} tokens > limit {limit}")]
pub struct CannotFit {
    /// Tokens of the core (with the summary at its smallest).
    pub core: u64,
    /// The limit.
    pub limit: u64,
}

/// What a plan starts from.
pub struct FitInput<'a> {
    /// The request as it would go upstream.
    pub view: &'a [Value],
    /// Tokens of each item of `view`.
    pub tokens: &'a [u64],
    /// Hashes of each item of `view` (name the archived originals).
    pub hashes: &'a [ItemHash],
    /// The compaction already applied to `view`, if any.
    pub base: Option<&'a Compaction>,
    /// The items must end up at or under this many tokens.
    pub limit: u64,
    /// Keep no verbatim tail (an explicit compaction request).
    pub whole: bool,
    /// Tokens of the smallest summary message (see [`summary_floor`]).
    pub summary_floor: u64,
    /// Leading items of `view` kept as they are, the summary after them:
    /// an earlier compaction's replacement a new summary is appended to
    /// (see [`super::append`]); 0 for none.
    pub kept: usize,
}

/// Truncation levels of the tail's tool outputs, gentlest first: the
/// ladder's own limits, then a quarter of them, then a few hundred bytes.
fn tail_levels(base: TruncateLimits) -> [TruncateLimits; 3] {
    let level = |keep: usize| TruncateLimits {
        max_bytes: keep * 2,
        keep_head: keep * 2 / 3,
        keep_tail: keep / 3,
    };
    let keep = base.keep_head + base.keep_tail;
    [
        base,
        level((keep / 4).max(MIN_KEEP_BYTES)),
        level(MIN_KEEP_BYTES),
    ]
}

/// Bytes of a tool output the hardest truncation keeps.
const MIN_KEEP_BYTES: usize = 240;

/// Fewer older user messages: the budget halved, quartered, then none but
/// the newest.
const USER_BUDGET_DIVISORS: [u64; 3] = [2, 4, 0];

/// Tokens of what a summary keeps verbatim for a cut: the system messages
/// and the recent user messages within `budget` (see [`cut::kept_verbatim`]).
fn users_tokens(view: &[Value], tokens: &[u64], lead: usize, cut: usize, budget: u64) -> u64 {
    let newest_is_here = latest_user(view).is_some_and(|i| i >= lead && i < cut);
    cut::kept_verbatim(&view[lead..cut], &tokens[lead..cut], budget, newest_is_here)
        .iter()
        .map(|&i| tokens[lead + i])
        .sum()
}

/// Plans the least destructive rewrite of `input.view` whose items fit
/// `input.limit`, with the summary at its floor; the summary then gets
/// what room is left ([`Plan::summary_budget`]).
pub fn plan(
    input: &FitInput<'_>,
    params: &Params,
    count: &dyn Fn(&Value) -> u64,
) -> Result<Plan, CannotFit> {
    let FitInput {
        view,
        tokens,
        hashes,
        base,
        limit,
        whole,
        summary_floor,
        kept,
    } = *input;
    let n = view.len();
    let total: u64 = tokens.iter().sum();
    let safe = cut::safe_cuts(view);
    // A provider compaction item and what precedes it stay as they are.
    let lead = leading_system(view)
        .max(super::boundary::safe_floor(view, &safe))
        .max(kept.min(n));
    let lead_tokens: u64 = tokens[..lead].iter().sum();
    let min_cut = base.map(|b| b.replacement.len()).unwrap_or(0);
    // A cut must map back to the client's items and leave a tail (unless
    // the whole history is asked for).
    let end = if whole { n } else { n.saturating_sub(1) };
    let cuts: Vec<usize> = (lead + 1..=end)
        .filter(|&i| safe[i] && i >= min_cut && rewrite::view_to_original(i, base).is_some())
        .collect();
    let cannot = |core| CannotFit { core, limit };
    let (Some(&first_cut), Some(&last_cut)) = (cuts.first(), cuts.last()) else {
        return Err(cannot(total));
    };
    let start = if whole {
        last_cut
    } else {
        cut::choose_cut(view, tokens, params.tail_budget)
            .map(|c| c.max(first_cut))
            .and_then(|c| cuts.iter().copied().find(|&k| k >= c))
            .unwrap_or(last_cut)
    };
    let suffix = |c: usize| -> u64 { tokens[c..].iter().sum() };
    let make = |cut: usize, users: u64, tail: u64, trunc, step| {
        let used =
            lead_tokens + summary_floor + users_tokens(view, tokens, lead, cut, users) + tail;
        (used <= limit).then(|| Plan {
            prepared: Prepared {
                cut,
                covered_len: rewrite::view_to_original(cut, base).unwrap_or(cut),
                lead,
                before: total,
                tail,
            },
            user_budget: users,
            tail_truncate: trunc,
            summary_budget: limit - (used - summary_floor),
            step,
        })
    };
    let users = params.recent_user_budget;
    // 1 and 2: the ladder's cut, then later ones.
    for &c in cuts.iter().filter(|&&c| c >= start) {
        let step = if c == start {
            Step::Ladder
        } else {
            Step::LaterCut
        };
        if let Some(p) = make(c, users, suffix(c), None, step) {
            return Ok(p);
        }
    }
    // 3: the smallest tail's tool outputs, truncated harder and harder.
    let tail = &view[last_cut..];
    let mut tail_tokens = suffix(last_cut);
    let mut hardest = None;
    for level in tail_levels(params.truncate) {
        let (truncated, changed) = ladder::truncate_outputs(tail, &hashes[last_cut..], level);
        if changed == 0 {
            continue;
        }
        tail_tokens = tail_tokens.min(truncated.iter().map(count).sum());
        hardest = Some(level);
        if let Some(p) = make(last_cut, users, tail_tokens, hardest, Step::TruncateTail) {
            return Ok(p);
        }
    }
    // 4: fewer older user messages (the newest one always stays).
    for d in USER_BUDGET_DIVISORS {
        let budget = users.checked_div(d).unwrap_or(0);
        if let Some(p) = make(last_cut, budget, tail_tokens, hardest, Step::FewerUsers) {
            return Ok(p);
        }
    }
    // 5: the core did not fit.
    Err(cannot(
        lead_tokens + summary_floor + users_tokens(view, tokens, lead, last_cut, 0) + tail_tokens,
    ))
}

/// A planned rewrite, with its summary.
#[derive(Debug, Clone)]
pub struct Applied {
    /// What replaces the first `covered_len` original items.
    pub replacement: Vec<Value>,
    /// Original items replaced.
    pub covered_len: usize,
    /// Tokens of the request after (items only).
    pub after: u64,
    /// Older user messages kept verbatim.
    pub kept_users: usize,
    /// Items of the view sent verbatim after the replacement.
    pub tail_len: usize,
}

/// Builds the replacement a plan (made from `input`) describes around
/// `summary_text`: leading
/// items, the summary, the kept user messages, and, when the tail was
/// truncated, the truncated tail (which then belongs to the replacement).
pub fn apply(
    input: &FitInput<'_>,
    plan: &Plan,
    params: &Params,
    summary_text: String,
    count: &dyn Fn(&Value) -> u64,
) -> Applied {
    let FitInput {
        view,
        tokens,
        hashes,
        base,
        ..
    } = *input;
    let p = &plan.prepared;
    let params = Params {
        recent_user_budget: plan.user_budget,
        ..*params
    };
    let (mut replacement, mut after, kept_users) =
        summary_replacement(view, tokens, p, &params, summary_text, count);
    let mut covered_len = p.covered_len;
    let mut tail_len = view.len() - p.cut;
    if let Some(level) = plan.tail_truncate {
        let (truncated, _) = ladder::truncate_outputs(&view[p.cut..], &hashes[p.cut..], level);
        after = after - p.tail.min(after) + truncated.iter().map(count).sum::<u64>();
        replacement.extend(truncated);
        covered_len = rewrite::view_to_original(view.len(), base).unwrap_or(covered_len);
        tail_len = 0;
    }
    Applied {
        replacement,
        covered_len,
        after,
        kept_users,
        tail_len,
    }
}

/// Tokens of the smallest summary message the facts allow.
pub fn summary_floor(facts: &summary::Facts, covered: usize, count: &dyn Fn(&Value) -> u64) -> u64 {
    count(&items::user_message(summary::assemble(
        facts, None, covered, 0,
    )))
}

/// Tokens of the facts-only summary at its full size: what a plan should
/// leave room for before it keeps a long verbatim tail, so that the facts
/// are budgeted before the tail's bulk. `max_bytes` bounds the narrative,
/// not the facts: a small window's byte budget would otherwise cut facts a
/// shorter tail leaves room for. [`summary_floor`] is the fallback when no
/// plan can give the summary that much.
pub fn summary_wanted(
    facts: &summary::Facts,
    covered: usize,
    max_bytes: usize,
    count: &dyn Fn(&Value) -> u64,
) -> u64 {
    count(&items::user_message(summary::assemble(
        facts,
        None,
        covered,
        facts_bytes(facts, covered, max_bytes),
    )))
}

/// Bytes the summary may take: `max_bytes`, or more when the facts alone
/// need more (up to [`MAX_FACTS_BYTES`]); the token budget then decides.
fn facts_bytes(facts: &summary::Facts, covered: usize, max_bytes: usize) -> usize {
    let whole = summary::assemble(facts, None, covered, MAX_FACTS_BYTES).len();
    max_bytes.max(whole)
}

/// Largest facts-only summary, bytes, whatever the window: the facts are
/// bounded (errors, files and statements are capped), this bounds their
/// sum.
const MAX_FACTS_BYTES: usize = 48_000;

/// Most attempts at shrinking a summary into its budget.
const SHRINK_ROUNDS: usize = 8;

/// The assembled summary, shrunk until its message fits `budget` tokens
/// (or is as small as the facts allow): bytes are cut in proportion to
/// the excess, so a few rounds suffice.
pub fn fitted_summary(
    facts: &summary::Facts,
    narrative: Option<&str>,
    covered: usize,
    max_bytes: usize,
    budget: u64,
    count: &dyn Fn(&Value) -> u64,
) -> String {
    let fits = |t: &str| count(&items::user_message(t.to_string())) <= budget;
    let mut bytes = facts_bytes(facts, covered, max_bytes);
    let mut text = summary::assemble(facts, narrative, covered, bytes);
    for _ in 0..SHRINK_ROUNDS {
        let t = count(&items::user_message(text.clone()));
        if t <= budget || bytes == 0 {
            break;
        }
        let scaled = (text.len().min(bytes) as f64 * budget as f64 / t as f64 * 0.9) as usize;
        bytes = scaled.min(bytes.saturating_sub(1));
        text = summary::assemble(facts, narrative, covered, bytes);
    }
    // The narrative's sections clipped to their shortest can still be more
    // than the facts alone ([`summary_floor`] is measured without one).
    if !fits(&text) && narrative.is_some() {
        return fitted_summary(facts, None, covered, max_bytes, budget, count);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CompactionConfig, ModelLimits};
    use crate::wire::item_hash;
    use serde_json::json;

    fn count(v: &Value) -> u64 {
        v.to_string().len() as u64 / 4 + 1
    }

    fn params(window: u64) -> Params {
        Params::new(
            &CompactionConfig::default(),
            &ModelLimits {
                context_window: window,
                max_output_tokens: window / 4,
                trigger_ratio: 0.75,
                trigger_max_tokens: 0,
            },
        )
    }

    /// A turn whose tail holds most of the request: one user message, then
    /// tool batches with large outputs.
    fn codex_like() -> Vec<Value> {
        let mut v = vec![
            json!({"role": "system", "content": "sys"}),
            json!({"role": "user", "content": "old question"}),
            json!({"role": "assistant", "content": "old answer"}),
            json!({"role": "user", "content": "fix the build"}),
        ];
        for k in 0..6 {
            v.push(json!({"role": "assistant", "tool_calls": [{"id": format!("c{k}")}]}));
            v.push(json!({"role": "tool", "tool_call_id": format!("c{k}"), "content": "o".repeat(6000)}));
        }
        v
    }

    fn input<'a>(
        view: &'a [Value],
        tokens: &'a [u64],
        hashes: &'a [ItemHash],
        limit: u64,
    ) -> FitInput<'a> {
        FitInput {
            view,
            tokens,
            hashes,
            base: None,
            limit,
            whole: false,
            summary_floor: 50,
            kept: 0,
        }
    }

    #[test]
    fn escalates_step_by_step_and_the_result_fits() {
        let view = codex_like();
        let tokens: Vec<u64> = view.iter().map(count).collect();
        let hashes: Vec<ItemHash> = view.iter().map(item_hash).collect();
        // A tail budget of 4000 tokens: the last two batches.
        let p = params(20_000);
        let mut steps = Vec::new();
        for limit in [6_000, 2_500, 1_000, 300] {
            let fit = input(&view, &tokens, &hashes, limit);
            let plan = plan(&fit, &p, &count).unwrap();
            let text = "s".repeat(plan.summary_budget.min(400) as usize);
            let a = apply(&fit, &plan, &p, text, &count);
            assert!(a.after <= limit, "{limit}: {} ({:?})", a.after, plan.step);
            steps.push(plan.step);
        }
        assert_eq!(steps[0], Step::Ladder);
        assert!(steps.contains(&Step::LaterCut), "{steps:?}");
        assert!(steps.contains(&Step::TruncateTail), "{steps:?}");
        assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
        let err = plan(&input(&view, &tokens, &hashes, 60), &p, &count).unwrap_err();
        assert!(err.core > 60, "{err}");
    }

    #[test]
    fn a_truncated_tail_moves_into_the_replacement() {
        let view = codex_like();
        let tokens: Vec<u64> = view.iter().map(count).collect();
        let hashes: Vec<ItemHash> = view.iter().map(item_hash).collect();
        let p = params(100_000);
        let fit = input(&view, &tokens, &hashes, 600);
        let plan = plan(&fit, &p, &count).unwrap();
        assert!(plan.tail_truncate.is_some(), "{:?}", plan.step);
        let a = apply(&fit, &plan, &p, "sum".into(), &count);
        assert_eq!((a.covered_len, a.tail_len), (view.len(), 0));
        let last = a.replacement.last().unwrap();
        assert_eq!(last["tool_call_id"], "c5");
        assert!(last["content"]
            .as_str()
            .unwrap()
            .contains("bytes of tool output elided"));
        // The newest user message is kept verbatim.
        assert!(a.replacement.contains(&view[3]));
    }

    #[test]
    fn nothing_to_cut_cannot_fit() {
        let view = vec![
            json!({"role": "system", "content": "s".repeat(4000)}),
            json!({"role": "user", "content": "hi"}),
        ];
        let tokens: Vec<u64> = view.iter().map(count).collect();
        let hashes: Vec<ItemHash> = view.iter().map(item_hash).collect();
        let err = plan(&input(&view, &tokens, &hashes, 500), &params(4096), &count).unwrap_err();
        assert_eq!(err.core, tokens.iter().sum::<u64>());
    }

    /// A small window's byte budget bounds the narrative, not the facts:
    /// with tokens to spare, the facts a 1,024-byte budget would cut stay.
    #[test]
    fn a_small_byte_budget_does_not_cut_facts_the_tokens_have_room_for() {
        let mut facts = summary::extract_facts(&codex_like(), None);
        facts.next_steps = vec!["Next step: regenerate tests/fixtures/ledger_Q7.csv".into()];
        facts.decisions =
            vec!["Decision: convert at the writer because the parser rejects offsets".into()];
        facts.errors = (0..4)
            .map(|i| {
                format!(
                    "thread 't{i}' panicked at src/csv.rs:88:14:\nexpected `Z`, got `+01:00` ({i})"
                )
            })
            .collect();
        let full = summary::assemble(&facts, None, 10, usize::MAX);
        assert!(full.len() > 1_024, "{}", full.len());
        let wanted = summary_wanted(&facts, 10, 1_024, &count);
        assert!(
            wanted >= count(&items::user_message(full.clone())),
            "{wanted}"
        );
        let text = fitted_summary(&facts, None, 10, 1_024, wanted, &count);
        for kept in facts
            .errors
            .iter()
            .chain(&facts.next_steps)
            .chain(&facts.decisions)
        {
            assert!(text.contains(kept.as_str()), "{kept} cut:\n{text}");
        }
        // Short of tokens, the facts still give way, lowest first.
        let tight = fitted_summary(&facts, None, 10, 1_024, wanted / 2, &count);
        assert!(count(&items::user_message(tight.clone())) <= wanted / 2 + 8);
        assert!(tight.contains(facts.next_steps[0].as_str()), "{tight}");
        assert!(!tight.contains(facts.decisions[0].as_str()), "{tight}");
    }

    #[test]
    fn a_summary_shrinks_into_its_budget() {
        let facts = summary::extract_facts(&codex_like(), None);
        let narrative = summary::NARRATIVE_SECTIONS
            .iter()
            .map(|h| format!("## {h}\n{}\n", "word ".repeat(300)))
            .collect::<String>();
        let floor = summary_floor(&facts, 10, &count);
        let text = fitted_summary(&facts, Some(&narrative), 10, 48_000, floor + 200, &count);
        assert!(count(&items::user_message(text.clone())) <= floor + 200);
        assert!(text.starts_with(items::SUMMARY_MARKER), "{text}");
    }
}
