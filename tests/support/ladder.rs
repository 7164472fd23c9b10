//! The compaction the engine computes, without the engine: the ladder with
//! the deterministic fallback summary (no model), for the property tests
//! of the history invariants.

use std::sync::Arc;

use compactor::compaction::{
    cheap_rungs, prepare, rewrite, summary, summary_replacement, Compaction, Params, Rung,
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
    let view = match base {
        Some(b) => rewrite::rewrite(items, b),
        None => items.to_vec(),
    };
    let hashes: Vec<ItemHash> = view.iter().map(item_hash).collect();
    let tokens: Vec<u64> = view.iter().map(count).collect();
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
    let chains = chain_hashes(&items.iter().map(item_hash).collect::<Vec<_>>());
    Some(Compaction {
        id: format!("cmp_{}", prep.covered_len),
        tenant: "t".into(),
        conversation: "c".into(),
        covered_len: prep.covered_len,
        covered_chain: chains[prep.covered_len - 1],
        replacement,
        rung,
        reason: "test".into(),
        tokens_before: prep.before,
        tokens_after: after,
        items_removed: 0,
        items_kept: 0,
        summary: None,
        facts: None,
        base: base.map(|b| b.id.clone()),
        summary_calls: 0,
        summary_tokens: 0,
        summary_output_tokens: 0,
        tokens_saved: 0,
        observed: false,
        audit: None,
        duration_ms: 0,
        created_ms: 0,
        made: Default::default(),
    })
}
