//! What an exchange's end tells the rest of the proxy: the accounting line,
//! the estimate and calibration behind it, the decision on the next
//! compaction, and the record's figures on the request's span.

use std::sync::Arc;

use super::pending::PendingExchange;
use crate::app::AppState;
use crate::compaction::Compaction;
use crate::config::{Mode, ModelLimits};
use crate::engine;
use crate::store::ExchangeRecord;
use crate::wire::{chain_extend, Usage};

/// Whether the estimate after an exchange with reported `usage` is read by
/// anything: the calibration of reported against estimated tokens, which
/// the fit check and the compaction's budget use once a conversation nears
/// its trigger (from half of it), and the token counts the next request's
/// fit check takes when its bytes (`bytes` this time) no longer clear the
/// hard limit by themselves. A conversation far from both needs none; its
/// items are counted once it gets there.
fn needs_estimate(limits: &ModelLimits, usage: Usage, bytes: u64) -> bool {
    let half_trigger = crate::compaction::policy::trigger_tokens(limits) / 2;
    usage.total() >= half_trigger || bytes >= crate::compaction::policy::hard_limit(limits) / 2
}
impl PendingExchange {
    /// Whether the proxy decides on the next compaction after this
    /// exchange: not when compaction is off, nor after a client's own
    /// compaction request (which starts none of the proxy's).
    pub(in crate::server) fn decides_next(&self) -> bool {
        self.request.mode() != Mode::Off && !self.conversation.client_compaction
    }

    /// The per-exchange accounting line: reported usage, estimate by
    /// section of what was sent (where something reads it: see
    /// [`needs_estimate`]), fraction of the model's window, whether past
    /// `warn_ratio`. Then the compaction decision for the next request.
    pub(in crate::server) fn account(
        &self,
        state: &Arc<AppState>,
        usage: Option<Usage>,
        status: u16,
        complete: bool,
    ) {
        let background = state.background;
        let state = state.clone();
        let (api, tools, view) = (
            self.request.api(),
            self.request.tools().cloned(),
            self.upstream.view.clone(),
        );
        // The request's own hashes and chains, unless a compaction changed
        // what was sent.
        let sent_as_received = Arc::ptr_eq(&self.upstream.view, self.request.items());
        let hashes = self.view_hashes();
        let chains = sent_as_received.then(|| self.digest.chains.clone());
        // Without reported usage the estimate decides (only a complete
        // answer says how large the conversation now is).
        let next = (complete
            && usage.is_none()
            && self.request.mode() != Mode::Off
            && !self.conversation.client_compaction)
            .then(|| self.input(String::new(), false));
        let potential = self
            .upstream
            .observed
            .as_deref()
            .map(Compaction::saved)
            .unwrap_or(0);
        let (conversation, model, id) = (
            self.conversation().to_string(),
            self.request.model().to_string(),
            self.conversation.id,
        );
        let tenant = self.request.tenant().to_string();
        let compaction = self.upstream.compaction.as_ref().map(|c| c.id.clone());
        let bytes = self.request.raw_len() as u64;
        background.spawn(move || {
            let limits = state.model_limits(&model);
            // What the reported usage measured: the items sent, by their
            // chain, and the tools (the hard-limit check adds to it).
            let sent = usage.filter(|_| complete).map(|u| {
                let chain = match (&chains, &hashes) {
                    (Some(c), _) if c.len() == view.len() => c.last().copied().unwrap_or([0; 32]),
                    (_, Some(h)) if h.len() == view.len() => chain_extend([0; 32], h),
                    _ => chain_extend([0; 32], &view.hashes()),
                };
                engine::Reported {
                    chain,
                    tools: tools.as_ref().map(|t| t.hash),
                    input_tokens: u.input_tokens,
                }
            });
            if let Some(sent) = sent {
                state.compactions.report(&tenant, &conversation, sent);
            }
            let est = usage
                .is_none_or(|u| needs_estimate(&limits, u, bytes))
                .then(|| {
                    let hashes = hashes.unwrap_or_else(|| Arc::new(view.hashes()));
                    // The provider reads from its newest compaction item on,
                    // and so does its reported usage: the estimate counts the
                    // same.
                    let (view, hashes, chains) = match crate::compaction::boundary::newest_in(&view)
                    {
                        Some(b) if b > 0 && hashes.len() == view.len() => (
                            Arc::new(view.with_prefix_replaced(b, &[])),
                            Arc::new(hashes[b..].to_vec()),
                            None,
                        ),
                        _ => (view, hashes, chains),
                    };
                    state.tokens.estimate_chained(
                        api,
                        &view,
                        &hashes,
                        chains.as_deref().map(Vec::as_slice),
                        tools.as_ref(),
                    )
                });
            let (used, source) = match (usage, &est) {
                (Some(u), _) => (u.total(), "reported"),
                (None, est) => (est.as_ref().map_or(0, |e| e.total()), "estimate"),
            };
            if let (Some(u), Some(est)) = (usage, &est) {
                state
                    .compactions
                    .calibrate(&tenant, &conversation, u.input_tokens, est.total());
            }
            let fraction = used as f64 / limits.context_window as f64;
            // Past `warn_ratio` is ordinary for a long conversation (the
            // trigger is beyond it): the line says so at info, a field to
            // filter on, not a warning on an operator's screen.
            let past_warn_ratio = fraction >= state.config.compaction.warn_ratio;
            tracing::info!(
                conversation = %conversation, exchange = id, model = %model, status,
                compaction = compaction.as_deref().unwrap_or(""),
                input_tokens = usage.map(|u| u.input_tokens),
                output_tokens = usage.map(|u| u.output_tokens),
                tokens = used, tokens_source = source,
                est_system = est.as_ref().map(|e| e.system),
                est_messages = est.as_ref().map(|e| e.messages),
                est_tool_outputs = est.as_ref().map(|e| e.tool_outputs),
                est_tool_definitions = est.as_ref().map(|e| e.tool_definitions),
                window = limits.context_window, fraction = format!("{fraction:.3}"),
                past_warn_ratio,
                "exchange"
            );
            if let Some(input) = next {
                engine::after_exchange(&state, input, used.saturating_sub(potential), true);
            }
        });
    }

    /// The record's token figures and compaction, on the request's span.
    pub(in crate::server) fn record_on_span(&self, rec: &ExchangeRecord) {
        if let Some(u) = rec.usage {
            self.timing.span.record("input_tokens", u.input_tokens);
            self.timing.span.record("output_tokens", u.output_tokens);
        }
        if let Some(c) = &rec.compaction {
            self.timing.span.record("compaction", c.as_str());
        }
    }
}
