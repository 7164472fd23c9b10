//! The rungs a compaction climbs: the cheap ones (no model call), then the
//! summary, planned from the counts and written by the provider's
//! compaction or the summarizer.

use std::sync::Arc;

use serde_json::Value;

use super::context::Context;
use super::counted::Counted;
use super::error::CompactError;
use super::input::{goal_kind, Input};
use super::provider;
use super::summarizer::{cached_body, summarize, SummaryCost, INSTRUCTION_TOKENS};
use crate::compaction::append::{self, Earlier};
use crate::compaction::fit::{self, CannotFit, FitInput};
use crate::compaction::summary;
use crate::compaction::{cheap_rungs, prepare, Compaction, Params, Prepared, Rung};

/// The largest share of a compaction's limit, as a divisor, that a plan
/// keeps for the facts summary before it settles for the summary's floor.
const FACTS_SHARE_OF_LIMIT: u64 = 3;

/// What a rung made, before the breaker and the audit.
pub(super) struct Made {
    pub(super) rung: Rung,
    pub(super) prepared: Prepared,
    pub(super) applied: fit::Applied,
    /// The summary's text (the summary rungs).
    pub(super) summary: Option<String>,
    pub(super) facts: Option<summary::Facts>,
    pub(super) cost: SummaryCost,
    /// The step of the fit plan reached (the summary rungs).
    pub(super) step: Option<fit::Step>,
    /// The summary came from the provider's compaction.
    pub(super) by_provider: bool,
    /// What a summary did with the earlier summaries.
    pub(super) summaries: Earlier,
}

/// The cheap rungs: they cost no model call. The model's notes of what to
/// keep go in a summary: no cheap rung then, nor for a whole compaction.
pub(super) fn cheap(input: &Input, counted: &Counted) -> Option<Made> {
    if input.ask.whole || input.ask.keep.is_some() {
        return None;
    }
    let (view, base, params) = (counted.view(), counted.base(input), counted.params);
    let prepared = prepare(view, &counted.tokens, base, &params)?;
    let p = Params {
        target_tokens: params
            .target_tokens
            .saturating_sub(counted.outside)
            .min(counted.limit),
        ..params
    };
    let count = |v: &Value| counted.count(v);
    let (rung, replacement, after) = cheap_rungs(view, &counted.hashes, &prepared, &p, &count)?;
    let applied = fit::Applied {
        covered_len: prepared.covered_len,
        tail_len: view.len() - prepared.cut,
        replacement,
        after,
        kept_users: 0,
    };
    Some(Made {
        rung,
        prepared,
        applied,
        summary: None,
        facts: base.and_then(|b| b.facts.clone()),
        cost: SummaryCost::default(),
        step: None,
        by_provider: false,
        summaries: Earlier::None,
    })
}

/// The summary rung: planned from the counts, then written by the
/// provider's compaction when the compaction asks it, else by the
/// summarizer.
pub(super) async fn summary_rung<S: Context>(
    state: &Arc<S>,
    input: &Input,
    counted: &Counted,
) -> Result<Made, CompactError> {
    let (view, base) = (counted.view(), counted.base(input));
    // An earlier summary stays as the upstream cached it, the new one after
    // it, while the summaries fit their budget; not under the provider's
    // compaction, which is its own window.
    let provider_wanted = !input.serving.observe && provider::wanted(state, input);
    let earlier = match (input.ask.whole, input.ask.keep.is_some(), provider_wanted) {
        (false, false, false) => append::earlier(view, base, &counted.params),
        _ => Earlier::None,
    };
    let (plan, floor, summaries) = match earlier {
        Earlier::Append { kept } => match plan(state, input, counted, kept) {
            Ok((plan, floor)) => (plan, floor, earlier),
            // The earlier summaries leave no room within the limit: one.
            Err(_) => {
                let (plan, floor) = plan(state, input, counted, 0)?;
                (plan, floor, Earlier::Crowded)
            }
        },
        _ => {
            let (plan, floor) = plan(state, input, counted, 0)?;
            (plan, floor, earlier)
        }
    };
    let prepared = &plan.prepared;
    let part = &view[prepared.lead..prepared.cut];
    let facts = summary::extract_facts(part, base.and_then(|b| b.facts.as_ref()));
    if provider_wanted {
        if let Some(d) = by_provider(state, input, counted, &plan, &facts).await {
            return Ok(Made {
                rung: Rung::Summary,
                prepared: plan.prepared.clone(),
                applied: d.applied,
                summary: Some(d.facts_text),
                facts: Some(facts),
                cost: d.cost,
                step: Some(plan.step),
                by_provider: true,
                summaries,
            });
        }
    }
    Ok(by_summarizer(state, input, counted, (plan, floor), facts, summaries).await)
}

/// The fit plan's input: the counted view, its figures, and the
/// summary's floor.
fn fit_input<'a>(
    input: &Input,
    counted: &'a Counted,
    base: Option<&'a Compaction>,
    floor: u64,
    kept: usize,
) -> FitInput<'a> {
    FitInput {
        view: counted.view(),
        tokens: &counted.tokens,
        hashes: &counted.hashes,
        base,
        limit: counted.limit,
        whole: input.ask.whole,
        summary_floor: floor,
        kept,
    }
}

/// The summary's floor: the facts of everything after the leading items
/// (those an appended summary shows, after the `kept` ones: its own) bound
/// the smallest summary of any cut.
fn summary_floor(input: &Input, counted: &Counted, kept: usize) -> (summary::Facts, u64) {
    let view = counted.view();
    let lead = crate::compaction::items::leading_system(view)
        .max(crate::compaction::boundary::floor(view))
        .max(kept.min(view.len()));
    let base = counted.base(input);
    let widest = if kept > 0 {
        append::appended_facts(&view[lead..])
    } else {
        summary::extract_facts(&view[lead..], base.and_then(|b| b.facts.as_ref()))
    };
    let floor = fit::summary_floor(&widest, view.len(), &|v: &Value| counted.count(v));
    (widest, floor)
}

/// The summary's plan, decided from the counts before a summarizer call
/// is paid for, with the view's first `kept` items kept as they are (an
/// appended summary), and the summary's floor it was planned with; none
/// when not even the irreducible core fits (counted and logged, unless
/// `kept`: a plan without them may).
fn plan<S: Context>(
    state: &Arc<S>,
    input: &Input,
    counted: &Counted,
    kept: usize,
) -> Result<(fit::Plan, u64), CompactError> {
    let (view, params, limit) = (counted.view(), counted.params, counted.limit);
    let count = |v: &Value| counted.count(v);
    let (widest, floor) = summary_floor(input, counted, kept);
    let fit_input = fit_input(input, counted, counted.base(input), floor, kept);
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
    let planned =
        fit::plan(&roomy, &params, &count).or_else(|_| fit::plan(&fit_input, &params, &count));
    planned.map(|plan| (plan, floor)).map_err(|e| {
        if kept > 0 {
            return CompactError::CannotFit(e);
        }
        let tools_tokens = counted.tools_tokens;
        let calibration = state
            .compactions()
            .calibration(&input.who.tenant, &input.who.conversation);
        let upstream = |t: u64| (t as f64 * calibration).ceil() as u64;
        let e = CannotFit {
            core: upstream(e.core + tools_tokens),
            limit: upstream(e.limit + tools_tokens),
        };
        state.metrics().unfittable(goal_kind(input.ask.goal));
        tracing::warn!(
            conversation = %input.who.conversation, core = e.core, limit = e.limit,
            tools_tokens, goal = goal_kind(input.ask.goal),
            "no compaction can fit: system items, tools, the newest user message and the pending tool batch alone are over the limit; no summarizer call made"
        );
        e.into()
    })
}

/// The summary by the provider's compaction, if it gave one.
async fn by_provider<S: Context>(
    state: &Arc<S>,
    input: &Input,
    counted: &Counted,
    plan: &fit::Plan,
    facts: &summary::Facts,
) -> Option<provider::Delegated> {
    let rung = provider::Rung {
        view: counted.view(),
        tokens: &counted.tokens,
        hashes: &counted.hashes,
        plan,
        params: &counted.params,
        facts,
        limit: counted.limit,
        base: counted.base(input),
    };
    provider::summary_rung(state, input, rung, &|v: &Value| counted.count(v)).await
}

/// The summary by the summarizer (from the request the upstream last saw
/// when it fits, else from a transcript of the part), fitted to the plan;
/// the facts alone when it wrote nothing usable (the fallback rung).
async fn by_summarizer<S: Context>(
    state: &Arc<S>,
    input: &Input,
    counted: &Counted,
    (plan, floor): (fit::Plan, u64),
    facts: summary::Facts,
    summaries: Earlier,
) -> Made {
    let (view, params) = (counted.view(), counted.params);
    let count = |v: &Value| counted.count(v);
    let prepared = plan.prepared.clone();
    let part = &view[prepared.lead..prepared.cut];
    let kept = match summaries {
        Earlier::Append { kept } => kept,
        _ => 0,
    };
    let appended = kept > 0;
    // An appended summary shows its own facts; the merged ones are kept
    // for the next compaction and the audit.
    let own_facts = if appended {
        append::appended_facts(part)
    } else {
        facts.clone()
    };
    // Observe mode pays for no summary unless told to: the rung is
    // the summary's, its size the facts' plus the answer it would
    // have asked for (see below).
    let estimate = input.serving.observe && !state.config().compaction.observe_summaries;
    let (narrative, cost) = if estimate {
        (None, SummaryCost::default())
    } else {
        let cached = cached_body(state, input, &params, appended).filter(|body| {
            // It goes with the whole view: it must fit the window
            // with the instruction and the answer.
            let calibration = state
                .compactions()
                .calibration(&input.who.tenant, &input.who.conversation);
            let answer = ["max_tokens", "max_completion_tokens"]
                .iter()
                .find_map(|k| body.get(*k).and_then(Value::as_u64))
                .unwrap_or(params.summary_output_tokens);
            let asked = ((counted.before + counted.tools_tokens + INSTRUCTION_TOKENS) as f64
                * calibration)
                .ceil() as u64
                + answer;
            asked <= counted.limits.context_window
        });
        summarize(state, input, part, &params, cached).await
    };
    let rung = if narrative.is_some() || estimate {
        Rung::Summary
    } else {
        Rung::Fallback
    };
    // An appended summary's header counts the items it covers.
    let covered = match (appended, counted.base(input)) {
        (true, Some(b)) => prepared.covered_len.saturating_sub(b.covered_len),
        _ => prepared.covered_len,
    };
    let text = fit::fitted_summary(
        &own_facts,
        narrative.as_deref(),
        covered,
        params.summary_max_bytes,
        plan.summary_budget,
        &count,
    );
    let text = match input.ask.keep.as_deref() {
        Some(notes) => summary::with_notes(
            &text,
            facts.task.as_deref(),
            &crate::compaction::agent_tool::keep_section(notes),
        ),
        None => text,
    };
    let fit_input = fit_input(input, counted, counted.base(input), floor, kept);
    let mut applied = fit::apply(&fit_input, &plan, &params, text.clone(), &count);
    if estimate {
        let facts_only = count(&crate::compaction::items::user_message(text.clone()));
        let room = plan.summary_budget.saturating_sub(facts_only);
        applied.after += params.summary_output_tokens.min(room);
    }
    Made {
        rung,
        prepared,
        applied,
        summary: Some(text),
        facts: Some(facts),
        cost,
        step: Some(plan.step),
        by_provider: false,
        summaries,
    }
}
