//! Computing a compaction: the cheap rungs, the summary (the proxy's or the
//! provider's), the circuit breaker, the audit, and storing the result.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::attempt::Attempt;
use super::context::Context;
use super::count::{count_items, count_tools};
use super::error::CompactError;
use super::input::{goal_kind, Goal, Input};
use super::learned::{MAX_CALIBRATION, MIN_CALIBRATION};
use super::provider;
use super::summarizer::{cached_body, summarize, SummaryCost, INSTRUCTION_TOKENS};
use crate::compaction::fit::{self, CannotFit, FitInput};
use crate::compaction::policy::{fit_limit, hard_limit, FIT_MARGIN};
use crate::compaction::summary;
use crate::compaction::{cheap_rungs, prepare, rewrite, Compaction, Params, Rung};
use crate::wire::{item_hash, Api, ItemHash};

/// The tokens the items of a compacted request may take, in the proxy's
/// estimate: the goal's limit in the upstream's tokens, scaled by what the
/// upstream reported for this conversation, less the tool definitions. An
/// overflow answer that states the refused size calibrates the scale first.
fn items_limit<S: Context>(state: &Arc<S>, input: &Input, before: u64, tools_tokens: u64) -> u64 {
    let limits = state.model_limits(&input.model);
    let (tenant, conversation) = (input.tenant.as_str(), input.conversation.as_str());
    let sent = before + tools_tokens;
    let upstream_limit = match input.goal {
        Goal::Shrink => return (before as f64 * (1.0 - FIT_MARGIN)) as u64,
        Goal::HardLimit => hard_limit(&limits),
        Goal::Overflow { stated, max_output } => {
            // A figure far off the estimate is a canned or garbled message,
            // not this request's size.
            let ratio = stated.requested.unwrap_or(0) as f64 / sent.max(1) as f64;
            if let Some(requested) = stated.requested {
                if (MIN_CALIBRATION..=MAX_CALIBRATION).contains(&ratio) {
                    state
                        .compactions()
                        .calibrate(tenant, conversation, requested, sent);
                }
            }
            let calibration = state.compactions().calibration(tenant, conversation);
            let refused = (sent as f64 * calibration).ceil() as u64;
            fit_limit(stated, &limits, max_output, Some(refused))
        }
    };
    let calibration = state.compactions().calibration(tenant, conversation);
    ((upstream_limit as f64 / calibration) as u64).saturating_sub(tools_tokens)
}

/// The largest share of a compaction's limit, as a divisor, that a plan
/// keeps for the facts summary before it settles for the summary's floor.
const FACTS_SHARE_OF_LIMIT: u64 = 3;

/// Computes a compaction for `input`, stores it and makes it apply to later
/// requests. Logs one event with the figures; the outcome is kept with the
/// conversation's recent [`Attempt`]s.
pub async fn compact<S: Context>(
    state: &Arc<S>,
    input: Input,
) -> Result<Arc<Compaction>, CompactError> {
    let key = (input.tenant.clone(), input.conversation.clone());
    let result = compute(state, input).await;
    state.compactions().attempted(key, Attempt::of(&result));
    result
}

async fn compute<S: Context>(
    state: &Arc<S>,
    input: Input,
) -> Result<Arc<Compaction>, CompactError> {
    let started = Instant::now();
    let limits = state.model_limits(&input.model);
    let params = Params::new(&state.config().compaction, &limits);
    let mut input = input;
    if input.observe {
        // What the request would have been with the would-be compaction
        // before: the new one extends it, as it would in auto mode.
        if let Some(b) = &input.base {
            input.view = Arc::new(rewrite::rewrite(&input.view.values(), b).into());
        }
    }
    let input = input;
    let (hashes, mut tokens) = count_items(state, input.view.clone(), None).await?;
    let tools_tokens = count_tools(state, input.tools.clone()).await;
    let values = input.view.values();
    let view: &[Value] = &values;
    // The provider does not read what precedes its compaction item.
    crate::compaction::boundary::count_from_boundary(view, &mut tokens);
    let tokens = tokens;
    let base = input.base.as_deref();
    let before: u64 = tokens.iter().sum();
    let limit = items_limit(state, &input, before, tools_tokens);
    let counter = state.tokens().clone();
    let count = move |v: &Value| counter.count_item(&item_hash(v), v);
    // The target is the request's: what goes beside the items (the tool
    // definitions, a Messages `system`) counts against it too.
    let outside = tools_tokens + input.system.as_ref().map_or(0, &count);

    // The cheap rungs first: they cost no model call.
    // The model's notes of what to keep go in a summary: no cheap rung.
    let cheap = (!input.whole && input.keep.is_none())
        .then(|| prepare(view, &tokens, base, &params))
        .flatten()
        .and_then(|prepared| {
            let p = Params {
                target_tokens: params.target_tokens.saturating_sub(outside).min(limit),
                ..params
            };
            let (rung, replacement, after) = cheap_rungs(view, &hashes, &prepared, &p, &count)?;
            let applied = fit::Applied {
                covered_len: prepared.covered_len,
                tail_len: view.len() - prepared.cut,
                replacement,
                after,
                kept_users: 0,
            };
            Some((rung, prepared, applied))
        });
    // The summary came from the provider's compaction.
    let mut by_provider = false;
    let (rung, prepared, applied, summary_text, facts, cost, step) = match cheap {
        Some((rung, prepared, applied)) => (
            rung,
            prepared,
            applied,
            None,
            base.and_then(|b| b.facts.clone()),
            SummaryCost::default(),
            None,
        ),
        None => 'summary: {
            // Decided from the counts before a summarizer call is paid for:
            // the facts of everything after the leading items bound the
            // smallest summary of any cut.
            let lead = crate::compaction::items::leading_system(view)
                .max(crate::compaction::boundary::floor(view));
            let widest = summary::extract_facts(&view[lead..], base.and_then(|b| b.facts.as_ref()));
            let floor = fit::summary_floor(&widest, view.len(), &count);
            let fit_input = FitInput {
                view,
                tokens: &tokens,
                hashes: &hashes,
                base,
                limit,
                whole: input.whole,
                summary_floor: floor,
            };
            // Facts first: plan with room for the whole facts summary (at most
            // a third of the limit), so that the tail's bulk is cut before
            // the facts are; only when no plan leaves that much, with the
            // summary at its floor.
            let wanted = fit::summary_wanted(&widest, view.len(), params.summary_max_bytes, &count)
                .min(limit / FACTS_SHARE_OF_LIMIT)
                .max(floor);
            let roomy = FitInput {
                summary_floor: wanted,
                ..fit_input
            };
            let planned = fit::plan(&roomy, &params, &count)
                .or_else(|_| fit::plan(&fit_input, &params, &count));
            let plan = match planned {
                Ok(plan) => plan,
                Err(e) => {
                    let calibration = state
                        .compactions()
                        .calibration(&input.tenant, &input.conversation);
                    let upstream = |t: u64| (t as f64 * calibration).ceil() as u64;
                    let e = CannotFit {
                        core: upstream(e.core + tools_tokens),
                        limit: upstream(e.limit + tools_tokens),
                    };
                    state.metrics().unfittable(goal_kind(input.goal));
                    tracing::warn!(
                        conversation = %input.conversation, core = e.core, limit = e.limit,
                        tools_tokens, goal = goal_kind(input.goal),
                        "no compaction can fit: system items, tools, the newest user message and the pending tool batch alone are over the limit; no summarizer call made"
                    );
                    return Err(e.into());
                }
            };
            let prepared = plan.prepared.clone();
            let part = &view[prepared.lead..prepared.cut];
            let facts = summary::extract_facts(part, base.and_then(|b| b.facts.as_ref()));
            // Observe mode pays for no summary unless told to: the rung is
            // the summary's, its size the facts' plus the answer it would
            // have asked for (see below).
            let estimate = input.observe && !state.config().compaction.observe_summaries;
            let delegated = if !input.observe && provider::wanted(state, &input) {
                let rung = provider::Rung {
                    view,
                    tokens: &tokens,
                    hashes: &hashes,
                    plan: &plan,
                    params: &params,
                    facts: &facts,
                    limit,
                    base,
                };
                provider::summary_rung(state, &input, rung, &count).await
            } else {
                None
            };
            if let Some(d) = delegated {
                by_provider = true;
                break 'summary (
                    Rung::Summary,
                    prepared,
                    d.applied,
                    Some(d.facts_text),
                    Some(facts),
                    d.cost,
                    Some(plan.step),
                );
            }
            let (narrative, cost) = if estimate {
                (None, SummaryCost::default())
            } else {
                let cached = cached_body(state, &input, &params).filter(|body| {
                    // It goes with the whole view: it must fit the window
                    // with the instruction and the answer.
                    let calibration = state
                        .compactions()
                        .calibration(&input.tenant, &input.conversation);
                    let answer = ["max_tokens", "max_completion_tokens"]
                        .iter()
                        .find_map(|k| body.get(*k).and_then(Value::as_u64))
                        .unwrap_or(params.summary_output_tokens);
                    let asked = ((before + tools_tokens + INSTRUCTION_TOKENS) as f64 * calibration)
                        .ceil() as u64
                        + answer;
                    asked <= limits.context_window
                });
                summarize(state, &input, part, &params, cached).await
            };
            let rung = if narrative.is_some() || estimate {
                Rung::Summary
            } else {
                Rung::Fallback
            };
            let text = fit::fitted_summary(
                &facts,
                narrative.as_deref(),
                prepared.covered_len,
                params.summary_max_bytes,
                plan.summary_budget,
                &count,
            );
            let text = match input.keep.as_deref() {
                Some(notes) => summary::with_notes(
                    &text,
                    facts.task.as_deref(),
                    &crate::compaction::agent_tool::keep_section(notes),
                ),
                None => text,
            };
            let mut applied = fit::apply(&fit_input, &plan, &params, text.clone(), &count);
            if estimate {
                let facts_only = count(&crate::compaction::items::user_message(text.clone()));
                let room = plan.summary_budget.saturating_sub(facts_only);
                applied.after += params.summary_output_tokens.min(room);
            }
            (
                rung,
                prepared,
                applied,
                Some(text),
                Some(facts),
                cost,
                Some(plan.step),
            )
        }
    };
    // The circuit breaker: a compaction that does not shrink the request
    // below what the client sent (and under the limit) is not applied. A
    // compaction the client asked for (`whole`: Codex's in-band trigger,
    // `/v1/responses/compact`) is its answer: refusing it fails a request
    // that asked for nothing the upstream could not do, so a short history
    // whose kept system messages outweigh what the summary replaced is
    // still answered, as long as it fits and replaced something (a history
    // of one user message is still nothing to compact).
    let before = prepared.before;
    let replaced = prepared
        .cut
        .saturating_sub(prepared.lead)
        .saturating_sub(applied.kept_users);
    let breaker = |after: u64| {
        if (after < before || (input.whole && replaced > 0)) && after <= limit {
            return Ok(());
        }
        let err = CompactError::NoShrink { before, after };
        tracing::warn!(conversation = %input.conversation, rung = rung.as_str(), limit, error = %err, "compaction discarded");
        Err(err)
    };
    let after = applied.after;
    breaker(after)?;
    let kept_users = applied.kept_users;
    let mut prepared = prepared;
    prepared.covered_len = applied.covered_len;
    let mut reason = match step {
        Some(s) if s != fit::Step::Ladder => format!("{}; escalated: {}", input.reason, s.as_str()),
        _ => input.reason.clone(),
    };
    if by_provider {
        reason.push_str("; ");
        reason.push_str(crate::compaction::provider::PROVIDER_REASON);
    }
    match cost.cached {
        Some(None) => reason.push_str("; summary from the cached request"),
        Some(Some(miss)) => {
            reason.push_str("; summary from the cached request missed: ");
            reason.push_str(miss.as_str());
        }
        None => {}
    }
    if input.observe {
        reason.push_str("; observed");
        if rung == Rung::Summary && cost.calls == 0 {
            reason.push_str(", summary size estimated without a summarizer call");
        }
    }
    // The summary rungs extracted the facts already; the cheap rungs did not.
    let extracted;
    let audit_facts = match summary_text.as_ref().and(facts.as_ref()) {
        Some(f) => f,
        None => {
            let compacted = view.len() - applied.tail_len;
            extracted = summary::extract_facts(
                &view[prepared.lead..prepared.cut.min(compacted)],
                base.and_then(|b| b.facts.as_ref()),
            );
            &extracted
        }
    };
    let tail_len = applied.tail_len;
    let audited = audit(view, &hashes, audit_facts, applied, &count, {
        let ceiling = match input.goal {
            Goal::Shrink => limit.min(params.target_tokens.max(after)),
            _ => limit,
        };
        ceiling.min(prepared.before.saturating_sub(1)).max(after)
    });
    let after = audited.after;
    // A cheap rung over an earlier summary restores facts into that
    // summary's message, which stays the earlier compaction's text.
    let summary_text = summary_text.map(|t| audited.summary.unwrap_or(t));
    let (replacement, after) = match input.api {
        // A valid start of a Messages request (see `wire::messages`).
        // A provider compaction block and what precedes it go as sent; the
        // provider's own window is one already, its kept turns as they came.
        Api::Messages if !by_provider => {
            // The replacement starts with the view's items up to the lead.
            let keep = match crate::compaction::boundary::floor(&audited.replacement) {
                0 => 0,
                _ => prepared.lead,
            };
            let raw: u64 = audited.replacement.iter().map(&count).sum();
            let finished = crate::wire::messages::finish_replacement_after(
                audited.replacement,
                keep,
                tail_len == 0,
                crate::compaction::items::is_summary,
            );
            // Finishing adds a little (an opening user message, the
            // summary's text block, a breakpoint): the breaker judges
            // what is sent.
            let sent: u64 = finished.iter().map(&count).sum();
            let after = (after + sent).saturating_sub(raw);
            breaker(after)?;
            (finished, after)
        }
        _ => (audited.replacement, after),
    };
    let covered_chain = input.chains[prepared.covered_len - 1];
    let items_kept = prepared.lead + kept_users + tail_len;
    let c = Compaction {
        id: crate::ids::new_compaction_id(),
        tenant: input.tenant.clone(),
        conversation: input.conversation.clone(),
        covered_len: prepared.covered_len,
        covered_chain,
        replacement,
        rung,
        reason,
        tokens_before: prepared.before,
        tokens_after: after,
        items_removed: prepared.cut - prepared.lead - kept_users,
        items_kept,
        summary: summary_text,
        facts,
        base: base.map(|b| b.id.clone()),
        summary_calls: cost.calls,
        summary_tokens: cost.tokens,
        summary_output_tokens: cost.output_tokens,
        summary_cache: cost.cache,
        tokens_saved: prepared.before.saturating_sub(after)
            + base.map(Compaction::saved).unwrap_or(0),
        observed: input.observe,
        audit: Some(audited.audit),
        duration_ms: started.elapsed().as_millis() as u64,
        created_ms: crate::ids::now_ms(),
        made: Default::default(),
    };
    if let Err(e) = state.store().record_compaction(c.clone()).await {
        tracing::error!(error = %e, "compaction not recorded");
    }
    let c = Arc::new(c);
    if input.soft && !c.observed {
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
    state
        .metrics()
        .summary_cost(cost.calls, cost.tokens, cost.output_tokens);
    let summarizer = state.config().summarizer_model_for(&input.model);
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
    Ok(c)
}

/// The audit of a compaction about to be stored: `facts`, those the proxy
/// extracted from the compacted part, checked against the request it makes (its
/// replacement and the tail sent verbatim after it), the absent ones
/// restored to its facts message within `ceiling` tokens, and the refs of
/// the view's items it does not send as they were.
fn audit(
    view: &[Value],
    hashes: &[ItemHash],
    facts: &summary::Facts,
    applied: fit::Applied,
    count: &dyn Fn(&Value) -> u64,
    ceiling: u64,
) -> summary::Audited {
    let compacted = view.len() - applied.tail_len;
    let sent: std::collections::HashSet<ItemHash> =
        applied.replacement.iter().map(item_hash).collect();
    let removed = hashes[..compacted]
        .iter()
        .filter(|h| !sent.contains(*h))
        .map(crate::compaction::ladder::archive_ref)
        .collect();
    summary::audit_and_repair(
        facts,
        applied.replacement,
        &view[compacted..],
        applied.after,
        ceiling,
        removed,
        count,
    )
}
