//! Computing a compaction, as a sequence of named steps (see [`compute`]):
//! observe, count, the cheap rungs, the summary (the proxy's or the
//! provider's), the circuit breaker, the audit, the Messages finishing, and
//! keeping the result. A new policy step is one more line there.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::attempt::Attempt;
use super::context::Context;
use super::counted::{count, Counted};
use super::error::CompactError;
use super::input::{Goal, Input};
use super::rungs::{cheap, summary_rung, Made};
use super::summarizer::SummaryCost;
use crate::compaction::append::Earlier;
use crate::compaction::fit;
use crate::compaction::summary;
use crate::compaction::{rewrite, Compaction, Prepared, Rung};
use crate::wire::{item_hash, Api, ItemHash};

/// Computes a compaction for `input`, stores it and makes it apply to later
/// requests. Logs one event with the figures; the outcome is kept with the
/// conversation's recent [`Attempt`]s.
pub async fn compact<S: Context>(
    state: &Arc<S>,
    input: Input,
) -> Result<Arc<Compaction>, CompactError> {
    let key = (input.who.tenant.clone(), input.who.conversation.clone());
    let result = compute(state, input).await;
    state.compactions().attempted(key, Attempt::of(&result));
    result
}

/// The steps of a compaction, in order.
async fn compute<S: Context>(
    state: &Arc<S>,
    input: Input,
) -> Result<Arc<Compaction>, CompactError> {
    let started = Instant::now();
    let input = observe(input);
    let counted = count(state, &input).await?;
    let made = match cheap(&input, &counted) {
        Some(made) => made,
        None => summary_rung(state, &input, &counted).await?,
    };
    let breaker = Breaker::of(&input, &counted, &made);
    breaker.check(made.applied.after)?;
    let audited = audit(&input, &counted, made);
    let finished = finish_messages(&input, &counted, &breaker, audited)?;
    let (cost, by_provider) = (finished.cost, finished.by_provider);
    let summaries = finished.summaries;
    let c = compaction(&input, finished, started);
    Ok(keep(state, &input, c, cost, by_provider, summaries).await)
}

/// Observe mode: what the request would have been with the would-be
/// compaction before; the new one extends it, as it would in auto mode.
fn observe(input: Input) -> Input {
    let mut input = input;
    if input.serving.observe {
        if let Some(b) = &input.request.base {
            input.request.view = Arc::new(rewrite::rewrite(&input.request.view.values(), b).into());
        }
    }
    input
}

/// The circuit breaker: a compaction that does not shrink the request
/// below what the client sent (and under the limit) is not applied. A
/// compaction the client asked for (`whole`: Codex's in-band trigger,
/// `/v1/responses/compact`) is its answer: refusing it fails a request
/// that asked for nothing the upstream could not do, so a short history
/// whose kept system messages outweigh what the summary replaced is
/// still answered, as long as it fits and replaced something (a history
/// of one user message is still nothing to compact).
struct Breaker<'a> {
    /// The view's tokens.
    before: u64,
    /// Items the compaction replaced.
    replaced: usize,
    whole: bool,
    limit: u64,
    conversation: &'a str,
    rung: Rung,
}

impl<'a> Breaker<'a> {
    fn of(input: &'a Input, counted: &Counted, made: &Made) -> Self {
        let prepared = &made.prepared;
        Self {
            before: prepared.before,
            replaced: prepared
                .cut
                .saturating_sub(prepared.lead)
                .saturating_sub(made.applied.kept_users),
            whole: input.ask.whole,
            limit: counted.limit,
            conversation: &input.who.conversation,
            rung: made.rung,
        }
    }

    /// Whether a result of `after` tokens is applied (logged when not).
    fn check(&self, after: u64) -> Result<(), CompactError> {
        let (before, limit) = (self.before, self.limit);
        if (after < before || (self.whole && self.replaced > 0)) && after <= limit {
            return Ok(());
        }
        let err = CompactError::NoShrink { before, after };
        tracing::warn!(conversation = %self.conversation, rung = self.rung.as_str(), limit, error = %err, "compaction discarded");
        Err(err)
    }
}

/// A compaction's content once audited (and finished, for Messages).
struct Audited {
    rung: Rung,
    /// The plan's cut, covering what the result covers.
    prepared: Prepared,
    kept_users: usize,
    tail_len: usize,
    replacement: Vec<Value>,
    after: u64,
    summary: Option<String>,
    facts: Option<summary::Facts>,
    audit: summary::Audit,
    cost: SummaryCost,
    step: Option<fit::Step>,
    by_provider: bool,
    summaries: Earlier,
}

/// The audit of a compaction about to be stored: the facts the proxy
/// extracted from the compacted part checked against the request it makes
/// (its replacement and the tail sent verbatim after it), the absent ones
/// restored to its facts message within a ceiling, and the refs of the
/// view's items it does not send as they were.
fn audit(input: &Input, counted: &Counted, made: Made) -> Audited {
    let (view, limit, base) = (counted.view(), counted.limit, counted.base(input));
    let count = |v: &Value| counted.count(v);
    let Made {
        rung,
        mut prepared,
        applied,
        summary: summary_text,
        facts,
        cost,
        step,
        by_provider,
        summaries,
    } = made;
    let (after, kept_users, tail_len) = (applied.after, applied.kept_users, applied.tail_len);
    prepared.covered_len = applied.covered_len;
    // The summary rungs extracted the facts already; the cheap rungs did not.
    let extracted;
    let audit_facts = match summary_text.as_ref().and(facts.as_ref()) {
        Some(f) => f,
        None => {
            let compacted = view.len() - tail_len;
            extracted = summary::extract_facts(
                &view[prepared.lead..prepared.cut.min(compacted)],
                base.and_then(|b| b.facts.as_ref()),
            );
            &extracted
        }
    };
    let ceiling = match input.ask.goal {
        Goal::Shrink => limit.min(counted.params.target_tokens.max(after)),
        _ => limit,
    };
    let ceiling = ceiling.min(prepared.before.saturating_sub(1)).max(after);
    let compacted = view.len() - tail_len;
    let sent: std::collections::HashSet<ItemHash> =
        applied.replacement.iter().map(item_hash).collect();
    let removed = counted.hashes[..compacted]
        .iter()
        .filter(|h| !sent.contains(*h))
        .map(crate::compaction::ladder::archive_ref)
        .collect();
    let audited = summary::audit_and_repair(
        audit_facts,
        applied.replacement,
        &view[compacted..],
        applied.after,
        ceiling,
        removed,
        &count,
        summary_text.is_some(),
    );
    Audited {
        rung,
        prepared,
        kept_users,
        tail_len,
        replacement: audited.replacement,
        after: audited.after,
        // A summary rung restores facts into the summary it wrote; a cheap
        // rung into a message of their own after what it kept.
        summary: summary_text.map(|t| audited.summary.unwrap_or(t)),
        facts,
        audit: audited.audit,
        cost,
        step,
        by_provider,
        summaries,
    }
}

/// The Messages finishing: the replacement made a valid start of a
/// Messages request (see `wire::messages`), which the breaker judges again.
/// A provider compaction block and what precedes it go as sent; the
/// provider's own window is one already, its kept turns as they came.
fn finish_messages(
    input: &Input,
    counted: &Counted,
    breaker: &Breaker<'_>,
    audited: Audited,
) -> Result<Audited, CompactError> {
    let mut audited = audited;
    // The items the compaction wrote, in the API's own shape.
    let written = std::mem::take(&mut audited.replacement);
    audited.replacement = input.who.api.format().finish_replacement(written);
    if input.who.api != Api::Messages || audited.by_provider {
        return Ok(audited);
    }
    let count = |v: &Value| counted.count(v);
    // The replacement starts with the view's items up to the lead.
    let keep = match crate::compaction::boundary::floor(&audited.replacement) {
        0 => 0,
        _ => audited.prepared.lead,
    };
    let raw: u64 = audited.replacement.iter().map(count).sum();
    let finished = crate::wire::messages::finish_replacement_after(
        std::mem::take(&mut audited.replacement),
        keep,
        audited.tail_len == 0,
        crate::compaction::items::is_summary,
    );
    // Finishing adds a little (an opening user message, the summary's
    // text block, a breakpoint): the breaker judges what is sent.
    let sent: u64 = finished.iter().map(count).sum();
    let after = (audited.after + sent).saturating_sub(raw);
    breaker.check(after)?;
    audited.replacement = finished;
    audited.after = after;
    Ok(audited)
}

/// The reason a compaction records: the input's, and how it was made.
fn reason(input: &Input, a: &Audited) -> String {
    let mut reason = match a.step {
        Some(s) if s != fit::Step::Ladder => {
            format!("{}; escalated: {}", input.ask.reason, s.as_str())
        }
        _ => input.ask.reason.clone(),
    };
    if a.by_provider {
        reason.push_str("; ");
        reason.push_str(crate::compaction::provider::PROVIDER_REASON);
    }
    match a.cost.cached {
        Some(None) => reason.push_str("; summary from the cached request"),
        Some(Some(miss)) => {
            reason.push_str("; summary from the cached request missed: ");
            reason.push_str(miss.as_str());
        }
        None => {}
    }
    // A summary's earlier summaries: appended to, or rewritten (counted
    // in `keep`).
    match a.summaries {
        Earlier::Append { .. } => reason.push_str("; appended after the earlier summary"),
        Earlier::Rewrite { bytes, budget } => reason.push_str(&format!(
            "; earlier summaries rewritten: {bytes} bytes and a new one would pass their budget of {budget}"
        )),
        Earlier::Crowded => {
            reason.push_str("; earlier summaries rewritten: no room to append within the limit")
        }
        Earlier::None => {}
    }
    if input.serving.observe {
        reason.push_str("; observed");
        if a.rung == Rung::Summary && a.cost.calls == 0 {
            reason.push_str(", summary size estimated without a summarizer call");
        }
    }
    reason
}

/// The compaction made of `a`.
fn compaction(input: &Input, a: Audited, started: Instant) -> Compaction {
    let reason = reason(input, &a);
    let base = input.request.base.as_deref();
    let Audited {
        rung,
        prepared,
        kept_users,
        tail_len,
        replacement,
        after,
        summary,
        facts,
        audit,
        cost,
        ..
    } = a;
    Compaction {
        id: crate::ids::new_compaction_id(),
        tenant: input.who.tenant.clone(),
        conversation: input.who.conversation.clone(),
        covered_len: prepared.covered_len,
        covered_chain: input.request.chains[prepared.covered_len - 1],
        replacement,
        rung,
        reason,
        tokens_before: prepared.before,
        tokens_after: after,
        items_removed: prepared.cut - prepared.lead - kept_users,
        items_kept: prepared.lead + kept_users + tail_len,
        summary,
        facts,
        base: base.map(|b| b.id.clone()),
        summary_calls: cost.calls,
        summary_tokens: cost.tokens,
        summary_output_tokens: cost.output_tokens,
        summary_cache: cost.cache,
        tokens_saved: prepared.before.saturating_sub(after)
            + base.map(Compaction::saved).unwrap_or(0),
        observed: input.serving.observe,
        audit: Some(audit),
        duration_ms: started.elapsed().as_millis() as u64,
        created_ms: crate::ids::now_ms(),
        made: Default::default(),
    }
}

/// Keeps a compaction: recorded in the store, indexed for later requests
/// (a soft one waits for its first application), counted and logged.
async fn keep<S: Context>(
    state: &Arc<S>,
    input: &Input,
    c: Compaction,
    cost: SummaryCost,
    by_provider: bool,
    summaries: Earlier,
) -> Arc<Compaction> {
    if let Err(e) = state.store().record_compaction(c.clone()).await {
        tracing::error!(error = %e, "compaction not recorded");
    }
    let c = Arc::new(c);
    if input.ask.soft && !c.observed {
        state.compactions().running().wait(&c.id);
    }
    state.compactions().insert(c.clone());
    if let (false, Some(trigger)) = (c.observed, crate::metrics::trigger_of(&c.reason)) {
        state.metrics().compaction_trigger(trigger);
    }
    if by_provider && !c.observed {
        state.metrics().provider_compaction();
    }
    if !c.observed {
        state.metrics().compaction(
            c.rung.as_str(),
            crate::metrics::reason_kind(&c.reason),
            c.tokens_before.saturating_sub(c.tokens_after),
        );
    }
    if let (false, Some(a)) = (c.observed, &c.audit) {
        state.metrics().facts_audited(a);
    }
    if c.rung == Rung::Fallback {
        state.metrics().summary_fallback();
    }
    match (c.observed, summaries) {
        (false, Earlier::Append { .. }) => state.metrics().summaries(true),
        (false, Earlier::Rewrite { .. } | Earlier::Crowded) => state.metrics().summaries(false),
        _ => {}
    }
    state
        .metrics()
        .summary_cost(cost.calls, cost.tokens, cost.output_tokens);
    let summarizer = state.config().summarizer_model_for(&input.who.model);
    let output = cost.output_tokens.min(cost.tokens);
    state.metrics().summary_bill(
        crate::prices::of(state.config(), summarizer),
        crate::prices::Tokens {
            input: cost.tokens - output,
            cache_read: cost.cache.read,
            cache_write: cost.cache.write,
            cache_write_1h: cost.cache.write_1h,
            output,
        },
    );
    tracing::info!(
        compaction = %c.id, conversation = %c.conversation, rung = c.rung.as_str(), reason = %c.reason,
        tokens_before = c.tokens_before, tokens_after = c.tokens_after,
        items_removed = c.items_removed, items_kept = c.items_kept,
        duration_ms = c.duration_ms, summary_bytes = c.summary.as_ref().map(String::len).unwrap_or(0),
        summary_calls = c.summary_calls, summary_tokens = c.summary_tokens,
        summary_chunks_left_to_facts = cost.chunks_skipped, base = c.base.as_deref().unwrap_or(""),
        observed = c.observed,
        "compacted"
    );
    c
}
