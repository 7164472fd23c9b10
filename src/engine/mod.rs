//! The compaction engine: the I/O around the pure layer. Keeps the
//! per-tenant index of stored compactions, runs background jobs after a
//! triggering answer, computes reactive compactions on overflow, calls the
//! summarizer, stores results, and backs off from clients whose edits keep
//! compactions from ever matching.

mod attempt;
mod check;
mod idle;
mod index;
mod jobs;
pub mod provider;
pub mod rebuild;
mod summarizer;

pub use attempt::Attempt;
pub use check::{check_fit, Fit, FitCheck};
pub use idle::{is_cold, thread as idle_thread};
pub use index::{Compactions, LoadCompaction, Reported};
pub use jobs::schedule_agent;

/// After an exchange: the idle watch notes it (a conversation that goes
/// quiet is compacted while its cache is still warm), and the decision from
/// its usage may start a background compaction the next request will find.
pub fn after_exchange<S: Context>(
    state: &std::sync::Arc<S>,
    input: Input,
    used: u64,
    estimated: bool,
) {
    idle::after_exchange(state, &input, used);
    jobs::after_exchange(state, input, used, estimated);
}
pub use summarizer::{auth_headers, chunk_lines, provider_headers, SummarizerError};

use index::lock;
use summarizer::{cached_body, summarize, SummaryCost, INSTRUCTION_TOKENS};

use std::sync::Arc;
use std::time::Instant;

use http::HeaderMap;
use serde_json::Value;

use crate::compaction::fit::{self, CannotFit, FitInput};
use crate::compaction::policy::{fit_limit, hard_limit, Stated, FIT_MARGIN};
use crate::compaction::summary;
use crate::compaction::{cheap_rungs, prepare, rewrite, Compaction, Params, Rung};
use crate::config::{Config, ModelLimits};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::tokens::TokenCounter;
use crate::upstream::Upstream;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{item_hash, Api, ItemHash};

/// Bytes of one item's text shown to the summarizer (head and tail kept).
const TRANSCRIPT_ITEM_BYTES: usize = 2_000;
/// Bounds of the estimate calibration (a wild figure is a misreport).
const MIN_CALIBRATION: f64 = 0.5;
const MAX_CALIBRATION: f64 = 3.0;
/// Longest back-off, in triggering exchanges skipped.
const MAX_BACKOFF: u32 = 64;

/// Why no compaction came out.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// No safe cut leaves anything to compact.
    #[error("no safe cut point")]
    NothingToCompact,
    /// The result would not be smaller (circuit breaker).
    #[error("compaction discarded: {before} tokens before, {after} after")]
    NoShrink {
        /// Tokens before.
        before: u64,
        /// Tokens after.
        after: u64,
    },
    /// Not even the irreducible core fits: decided from token counts,
    /// before any summarizer call.
    #[error(transparent)]
    CannotFit(#[from] CannotFit),
    /// A worker thread failed (panicked or was cancelled).
    #[error("internal: a worker thread failed")]
    Internal(#[source] tokio::task::JoinError),
}

impl CompactError {
    /// The answer to a client that asked for this compaction: its history
    /// gave nothing to compact, unless the proxy itself failed.
    pub fn into_refusal(self) -> crate::error::ProxyError {
        match self {
            CompactError::Internal(detail) => crate::error::ProxyError::internal(detail),
            other => crate::error::ProxyError::NothingToCompact(Box::new(other)),
        }
    }
}

/// What a compaction starts from: the request as it would go upstream.
#[derive(Clone)]
pub struct Input {
    /// The conversation's wire format (the summary call uses it too).
    pub api: Api,
    /// Tenant.
    pub tenant: String,
    /// Conversation.
    pub conversation: String,
    /// The conversation's model.
    pub model: String,
    /// The request's items after any compaction already applied.
    pub view: Arc<ItemList>,
    /// Chain hashes of the original (client-sent) items.
    pub chains: Arc<Vec<ItemHash>>,
    /// The compaction already applied, if any.
    pub base: Option<Arc<Compaction>>,
    /// The client's credential headers, for the summarizer call (memory only).
    pub auth: HeaderMap,
    /// Why.
    pub reason: String,
    /// When the request arrived (Unix ms).
    pub requested_ms: i64,
    /// Compact the whole history, keeping no verbatim tail (explicit
    /// compaction requests: `/v1/responses/compact`, `compaction_trigger`).
    pub whole: bool,
    /// What the result must achieve.
    pub goal: Goal,
    /// The request's tool definitions (they count against the window).
    pub tools: Option<Tools>,
    /// The request's top-level `system` (Anthropic Messages), which the
    /// provider's compaction call sends as the conversation does.
    pub system: Option<Value>,
    /// Observe mode: the result is recorded as what the proxy would have
    /// done, never applied. `view` is then the client's items and `base`
    /// the would-be compaction before, which is applied here first.
    pub observe: bool,
    /// The request asks the provider to compact
    /// ([`crate::compaction::boundary::asks_provider_compaction`]): the
    /// threshold trigger leaves the conversation to it.
    pub provider_compaction: bool,
    /// The result is a background compaction (threshold, agent), counted at
    /// its first application: a threshold one's on the next request that
    /// extends it, the model's at the conversation's next turn boundary
    /// unless a request over the hard limit needs it sooner.
    pub soft: bool,
    /// The model's own notes of what to keep (its `compactor_compact`
    /// call): the compaction is a summary, and they are a section of it.
    pub keep: Option<String>,
    /// The threshold starts no compaction after this exchange: one already
    /// waits for the turn boundary, or the mode is manual.
    pub no_trigger: bool,
    /// The request as the upstream last saw it, for a summary call that
    /// reads its history from the upstream's prompt cache.
    pub sent: Option<Arc<Sent>>,
}

/// What the upstream last saw of a conversation's request, but its items
/// (the [`Input::view`]): a summary call that repeats it, with one user
/// message appended, reads everything before that message from the
/// upstream's prompt cache (see `engine::summarizer`).
#[derive(Debug, Clone)]
pub struct Sent {
    /// The body without its items: the model, `system`, `tool_choice`,
    /// thinking, sampling parameters, and `tools` as sent (the proxy's
    /// own among them).
    pub body: Value,
    /// The request's provider headers that decide what its body means
    /// (`anthropic-version`, `anthropic-beta`); the credentials are
    /// [`Input::auth`].
    pub headers: HeaderMap,
}

/// What a compaction must achieve; it escalates past the ladder until it
/// does, or declines before any summarizer call when nothing could.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Goal {
    /// Shrink the request by [`FIT_MARGIN`] at least (background, manual).
    #[default]
    Shrink,
    /// Fit the model's hard limit, window less max output (the pre-send
    /// check, explicit compaction requests).
    HardLimit,
    /// The upstream refused the request as too long.
    Overflow {
        /// What its answer stated.
        stated: Stated,
        /// The request's own max output, if it set one.
        max_output: Option<u64>,
    },
}

/// What the engine uses of the process's shared state, and nothing more: the
/// composition root implements it, so the engine names no server, and a
/// test can run it over a context of its own.
pub trait Context: Send + Sync + 'static {
    /// The configuration.
    fn config(&self) -> &Config;
    /// Records (compactions are stored through it).
    fn store(&self) -> &Store;
    /// Token estimates.
    fn tokens(&self) -> &Arc<TokenCounter>;
    /// Stored compactions and running compaction jobs.
    fn compactions(&self) -> &Compactions;
    /// Where compactions, fallbacks and summary costs are counted.
    fn metrics(&self) -> &Metrics;
    /// The client that calls the summarizer.
    fn summarizer(&self) -> &Upstream;
    /// The limits of a model, its window as the upstream told it.
    fn model_limits(&self, model: &str) -> ModelLimits;
}

/// Tokens of each item (tokenizer work, off the async threads).
async fn count_items<S: Context>(
    state: &Arc<S>,
    items: Arc<ItemList>,
    known: Option<Arc<Vec<ItemHash>>>,
) -> Result<(Vec<ItemHash>, Vec<u64>), CompactError> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let hashes: Vec<ItemHash> = match known {
            Some(h) if h.len() == items.len() => h.to_vec(),
            _ => items.hashes(),
        };
        let tokens = (0..items.len())
            .map(|i| st.tokens().count_item_with(&hashes[i], || items.item(i)))
            .collect();
        (hashes, tokens)
    })
    .await
    .map_err(CompactError::Internal)
}

/// Estimated tokens of a request view (`hashes`: its item hashes, when
/// already computed).
pub async fn estimate_view<S: Context>(
    state: &Arc<S>,
    view: Arc<ItemList>,
    hashes: Option<Arc<Vec<ItemHash>>>,
) -> u64 {
    count_items(state, view, hashes)
        .await
        .map(|(_, t)| t.iter().sum())
        .unwrap_or(0)
}

/// Tokens of a request's tool definitions (tokenizer work, off the async
/// threads).
async fn count_tools<S: Context>(state: &Arc<S>, tools: Option<Tools>) -> u64 {
    let Some(t) = tools else {
        return 0;
    };
    let counter = state.tokens().clone();
    tokio::task::spawn_blocking(move || counter.count_item(&t.hash, t.value()))
        .await
        .unwrap_or(0)
}

/// The label of a goal in logs and metrics.
fn goal_kind(goal: Goal) -> &'static str {
    match goal {
        Goal::Shrink => "shrink",
        Goal::HardLimit => "hard_limit",
        Goal::Overflow { .. } => "overflow",
    }
}

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
        lock(&state.compactions().waiting).insert(c.id.clone());
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
    state.metrics().summary_bill(
        crate::prices::of(state.config(), summarizer),
        cost.tokens,
        cost.output_tokens,
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

#[cfg(test)]
mod tests {
    use super::attempt::ATTEMPTS_KEPT;
    use super::index::BODIES;
    use super::summarizer::chunks_within_cap;
    use super::*;
    use crate::store::StoredCompaction;
    use foldhash::HashMap;
    use serde_json::json;

    #[test]
    fn attempts_keep_what_a_discarded_compaction_would_have_sent() {
        let registry = Compactions::default();
        let discarded: Result<Arc<Compaction>, CompactError> = Err(CompactError::NoShrink {
            before: 99,
            after: 259,
        });
        registry.attempted(("t".into(), "c".into()), Attempt::of(&discarded));
        let kept = registry.attempts("t", "c");
        assert_eq!(kept.len(), 1);
        assert_eq!(
            (kept[0].result, kept[0].tokens_before, kept[0].tokens_after),
            ("discarded", Some(99), Some(259))
        );
        assert!(registry.attempts("u", "c").is_empty(), "another tenant's");
        for _ in 0..ATTEMPTS_KEPT + 5 {
            registry.attempted(("t".into(), "c".into()), Attempt::of(&discarded));
        }
        assert_eq!(registry.attempts("t", "c").len(), ATTEMPTS_KEPT);
    }

    #[test]
    fn calibrations_are_per_tenant_and_conversation() {
        let c = Compactions::default();
        c.calibrate("t1", "conv", 200, 100);
        c.calibrate("ab", "c", 150, 100);
        assert_eq!(c.calibration("t1", "conv"), 2.0);
        assert_eq!(c.calibration("t2", "conv"), 1.0, "another tenant");
        assert_eq!(c.calibration("t1", "other"), 1.0, "another conversation");
        assert_eq!(c.calibration("ab", "c"), 1.5);
        assert_eq!(
            c.calibration("a", "bc"),
            1.0,
            "the pair, not its concatenation"
        );
    }

    /// The chain hash the tests give a prefix of `len` items.
    fn chain(len: usize) -> ItemHash {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&(len as u64).to_le_bytes());
        h
    }

    /// A compaction of `tenant` covering the first `len` items.
    fn stored(tenant: &str, len: usize) -> Compaction {
        crate::compaction::test_compaction(
            &format!("cmp_{tenant}_{len}"),
            tenant,
            len,
            chain(len),
            vec![json!({"role": "user", "content": format!("summary {len}")})],
        )
    }

    #[test]
    fn a_forgotten_compaction_is_found_neither_applied_nor_observed() {
        let (applied, mut observed) = (stored("t", 3), stored("t", 5));
        observed.id = "cmp_t_observed".into();
        observed.observed = true;
        let bodies: HashMap<String, Compaction> = [applied.clone(), observed.clone()]
            .into_iter()
            .map(|c| (c.id.clone(), c))
            .collect();
        let list = bodies.values().map(StoredCompaction::from).collect();
        let registry =
            Compactions::from_stored(list, Arc::new(move |id: &str| bodies.get(id).cloned()));
        let chains: Vec<ItemHash> = (1..=6).map(chain).collect();
        assert!(registry.find("t", &chains).is_some());
        assert!(registry.find_observed("t", &chains).is_some());
        registry.forget("t", &[applied.id.clone(), observed.id.clone()]);
        assert!(
            registry.find("t", &chains).is_none(),
            "applied one forgotten"
        );
        assert!(
            registry.find_observed("t", &chains).is_none(),
            "observed one forgotten"
        );
    }

    #[test]
    fn stored_compactions_are_found_with_bodies_read_when_not_kept() {
        // More than two generations of bodies, all in the "store".
        let n = 2 * BODIES + 40;
        let store: HashMap<String, Compaction> = (1..=n)
            .map(|len| stored("t", len))
            .map(|c| (c.id.clone(), c))
            .collect();
        let list = store.values().map(StoredCompaction::from).collect();
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = reads.clone();
        let registry = Compactions::from_stored(
            list,
            Arc::new(move |id: &str| {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                store.get(id).cloned()
            }),
        );
        assert_eq!(registry.len(), n);
        // A request whose first `len` items are each one's covered prefix.
        let chains = |len: usize| -> Vec<ItemHash> { (1..=len).map(chain).collect() };
        let c = registry.find("t", &chains(n)).expect("the longest one");
        assert_eq!((c.covered_len, c.replacement.len()), (n, 1));
        assert_eq!(
            reads.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "read once"
        );
        let again = registry.find("t", &chains(n)).unwrap();
        assert!(Arc::ptr_eq(&c, &again), "then kept");
        assert_eq!(reads.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(
            registry.find("other", &chains(n)).is_none(),
            "never another tenant's"
        );
        assert!(registry.get("other", &c.id).is_none());
        assert_eq!(
            registry.get("t", &c.id).map(|g| g.id.clone()),
            Some(c.id.clone())
        );
        // Every one is found, though not all bodies fit in memory at once.
        for len in 1..=n {
            let found = registry.find("t", &chains(len)).unwrap();
            assert_eq!(found.id, format!("cmp_t_{len}"));
        }
        assert!(lock(&registry.bodies).recent.len() <= 2 * BODIES);
        let before = reads.load(std::sync::atomic::Ordering::Relaxed);
        // Each once, and the longest (read first) again at the end of the
        // loop: more than two generations were read after it.
        assert_eq!(before, n + 1);
        registry.find("t", &chains(1)).unwrap();
        assert_eq!(
            reads.load(std::sync::atomic::Ordering::Relaxed),
            before + 1,
            "the oldest was dropped from memory and is read again"
        );
    }

    #[test]
    fn a_new_compaction_is_kept_without_a_store() {
        let registry = Compactions::default();
        let c = Arc::new(stored("t", 3));
        registry.insert(c.clone());
        let chains: Vec<ItemHash> = (1..=4).map(chain).collect();
        assert!(Arc::ptr_eq(&registry.find("t", &chains).unwrap(), &c));
        assert!(registry.find("t", &chains[..2]).is_none(), "covers 3 items");
    }

    #[test]
    fn the_call_cap_bounds_the_chunks_summarized() {
        assert_eq!(chunks_within_cap(3, 8), 3);
        assert_eq!(chunks_within_cap(76, 8), 6);
        assert_eq!(chunks_within_cap(5, 1), 1);
        assert_eq!(chunks_within_cap(5, 0), 0);
        assert_eq!(chunks_within_cap(0, 8), 0);
    }

    #[test]
    fn chunks_respect_the_budget() {
        let lines: Vec<String> = ["aaaa", "bb", "cccccc", "d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let chunks = chunk_lines(&lines, 6, |s| s.len() as u64);
        assert_eq!(chunks, vec!["aaaa\nbb\n", "cccccc\n", "d\n"]);
        assert!(chunk_lines(&[], 5, |s| s.len() as u64).is_empty());
    }
}
