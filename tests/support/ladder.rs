//! The compaction the engine computes, without the engine: the ladder with
//! the deterministic fallback summary (no model), for the property tests
//! of the history invariants.

use std::sync::Arc;

use compactor::compaction::fit::{self, FitInput};
use compactor::compaction::{
    boundary, cheap_rungs, items as kinds, prepare, rewrite, summary, summary_replacement,
    Compaction, Params, Rung,
};
use compactor::config::{CompactionConfig, ModelLimits};
use compactor::wire::{chain_hashes, item_hash, ItemHash};
use serde_json::Value;

/// Deterministic token stand-in: a token per 4 bytes of JSON.
pub fn count(v: &Value) -> u64 {
    v.to_string().len() as u64 / 4 + 1
}

/// The budgets of a 16k window with small tails, so generated histories
/// compact often.
pub fn params() -> Params {
    let cfg = CompactionConfig {
        tail_tokens: 1_500,
        recent_user_tokens: 300,
        ..CompactionConfig::default()
    };
    let limits = ModelLimits {
        context_window: 16_000,
        max_output_tokens: 1_000,
        trigger_ratio: 0.75,
        trigger_max_tokens: 0,
    };
    Params::new(&cfg, &limits)
}

/// One compaction of `items` on top of `base`, as the engine computes it,
/// its replacement given the wire format's last touches by `finish` (the
/// identity for the OpenAI APIs).
pub fn compact(
    items: &[Value],
    base: Option<&Arc<Compaction>>,
    p: &Params,
    finish: impl Fn(Vec<Value>) -> Vec<Value>,
) -> Option<Compaction> {
    let (view, hashes, tokens) = view_of(items, base);
    let prep = prepare(&view, &tokens, base.map(|b| b.as_ref()), p)?;
    let (rung, replacement, after) = match cheap_rungs(&view, &hashes, &prep, p, &count) {
        Some(r) => r,
        None => {
            let part = &view[prep.lead..prep.cut];
            let facts = summary::extract_facts(part, base.and_then(|b| b.facts.as_ref()));
            let text = summary::assemble(&facts, None, prep.covered_len, p.summary_max_bytes);
            let (rep, after, _) = summary_replacement(&view, &tokens, &prep, p, text, &count);
            (Rung::Fallback, rep, after)
        }
    };
    // The engine's circuit breaker judges the replacement as finished for
    // the wire, and discards what does not shrink.
    let raw: u64 = replacement.iter().map(count).sum();
    let replacement = finish(replacement);
    let after = (after + replacement.iter().map(count).sum::<u64>()).saturating_sub(raw);
    if after >= prep.before {
        return None;
    }
    Some(stored(
        items,
        base,
        prep.covered_len,
        replacement,
        rung,
        prep.before,
        after,
    ))
}

/// One compaction of `items` on top of `base` that must fit `limit` tokens,
/// as the engine computes it: the cheap rungs within the target and the
/// limit, else the summary (the deterministic fallback) with the fit's
/// escalation — later cuts, the smallest tail with its tool outputs
/// truncated into the replacement, fewer user messages. `finish` gives the
/// replacement the wire format's last touches, told whether nothing of
/// the client's request follows it. `None` when nothing fits or nothing
/// shrinks.
pub fn compact_within(
    items: &[Value],
    base: Option<&Arc<Compaction>>,
    p: &Params,
    limit: u64,
    finish: impl Fn(Vec<Value>, bool) -> Vec<Value>,
) -> Option<Compaction> {
    let (view, hashes, tokens) = view_of(items, base);
    let before: u64 = tokens.iter().sum();
    let base_c = base.map(|b| b.as_ref());
    let cheap = prepare(&view, &tokens, base_c, p).and_then(|prep| {
        let within = Params {
            target_tokens: p.target_tokens.min(limit),
            ..*p
        };
        let (rung, replacement, after) = cheap_rungs(&view, &hashes, &prep, &within, &count)?;
        Some((
            rung,
            replacement,
            after,
            prep.covered_len,
            view.len() - prep.cut,
        ))
    });
    let (rung, replacement, after, covered_len, tail_len) = match cheap {
        Some(c) => c,
        None => {
            let lead = kinds::leading_system(&view).max(boundary::floor(&view));
            let base_facts = base.and_then(|b| b.facts.as_ref());
            let widest = summary::extract_facts(&view[lead..], base_facts);
            let floor = fit::summary_floor(&widest, view.len(), &count);
            let input = FitInput {
                view: &view,
                tokens: &tokens,
                hashes: &hashes,
                base: base_c,
                limit,
                whole: false,
                summary_floor: floor,
                kept: 0,
            };
            let wanted = fit::summary_wanted(&widest, view.len(), p.summary_max_bytes, &count)
                .min(limit / 3)
                .max(floor);
            let roomy = FitInput {
                summary_floor: wanted,
                ..input
            };
            let plan = fit::plan(&roomy, p, &count)
                .or_else(|_| fit::plan(&input, p, &count))
                .ok()?;
            let prep = &plan.prepared;
            let facts = summary::extract_facts(&view[prep.lead..prep.cut], base_facts);
            let text = fit::fitted_summary(
                &facts,
                None,
                prep.covered_len,
                p.summary_max_bytes,
                plan.summary_budget,
                &count,
            );
            let a = fit::apply(&input, &plan, p, text, &count);
            (
                Rung::Fallback,
                a.replacement,
                a.after,
                a.covered_len,
                a.tail_len,
            )
        }
    };
    let raw: u64 = replacement.iter().map(count).sum();
    let replacement = finish(replacement, tail_len == 0);
    let after = (after + replacement.iter().map(count).sum::<u64>()).saturating_sub(raw);
    if after >= before || after > limit {
        return None;
    }
    Some(stored(
        items,
        base,
        covered_len,
        replacement,
        rung,
        before,
        after,
    ))
}

/// The request as it goes upstream with `base` applied, its items'
/// hashes and tokens.
fn view_of(
    items: &[Value],
    base: Option<&Arc<Compaction>>,
) -> (Vec<Value>, Vec<ItemHash>, Vec<u64>) {
    let view = match base {
        Some(b) => rewrite::rewrite(items, b),
        None => items.to_vec(),
    };
    let hashes = view.iter().map(item_hash).collect();
    let tokens = view.iter().map(count).collect();
    (view, hashes, tokens)
}

/// The compaction stored for `items`, covering their first `covered_len`.
fn stored(
    items: &[Value],
    base: Option<&Arc<Compaction>>,
    covered_len: usize,
    replacement: Vec<Value>,
    rung: Rung,
    before: u64,
    after: u64,
) -> Compaction {
    let chains = chain_hashes(&items.iter().map(item_hash).collect::<Vec<_>>());
    Compaction {
        id: format!("cmp_{covered_len}"),
        tokens_before: before,
        tokens_after: after,
        base: base.map(|b| b.id.clone()),
        created_ms: 0,
        ..Compaction::made_now(
            "t",
            "c",
            (covered_len, chains[covered_len - 1]),
            replacement,
            rung,
            "test".into(),
        )
    }
}
