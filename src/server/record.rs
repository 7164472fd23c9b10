//! Phase 5, record: runs when the answer is complete, cut short, or
//! refused by the proxy. Turns the exchange into its record, commits it
//! (before the last frame of an answer is released), indexes it and
//! queues the accounting line. It must not change what the client receives.

use std::sync::Arc;

use super::exchange::{Outcome, PendingExchange};
use crate::app::AppState;
use crate::compaction::{items, Compaction};
use crate::config::Mode;
use crate::engine;
use crate::error::ProxyError;
use crate::store::{
    bounded_text, ExchangeRecord, ExchangeSavings, IndexedExchange, RecordedWindow,
    MAX_PREVIEW_CHARS,
};
use crate::wire::items::Tools;
use crate::wire::{chain_extend, item_hash, ItemHash, Usage};

/// Most characters of an upstream error body kept in a record.
const MAX_ERROR_CHARS: usize = 4096;

/// Items looked through for a conversation's first user message.
const PREVIEW_SCAN: usize = 32;

/// Records an exchange that failed before an answer could be relayed and
/// returns the error for the client.
pub(super) async fn fail(
    state: &Arc<AppState>,
    pending: PendingExchange,
    err: ProxyError,
    ttfb_ms: Option<f64>,
) -> ProxyError {
    let outcome = Outcome {
        status: err.status().as_u16(),
        error: Some(err.to_string()),
        ttfb_ms,
        ..Outcome::default()
    };
    pending.finish(state, outcome).await;
    err
}

impl PendingExchange {
    /// Builds the record: claims item bodies not yet stored, computes chains.
    pub fn to_record(&self, state: &AppState, outcome: Outcome) -> ExchangeRecord {
        let mut new_items = Vec::new();
        // The items of the prefix an earlier exchange stands for were
        // claimed when that exchange was recorded, and so were those a
        // recorded recent request had too.
        let len = self.hashes.len();
        let suffix_from = self.ident.prefix.map(|p| p.len).unwrap_or(0).min(len);
        let known = self.claims.known();
        let before = suffix_from..known.start.clamp(suffix_from, len);
        let after = known.end.clamp(suffix_from, len)..len;
        for range in [before, after] {
            for j in state.store.claim_items(&self.hashes[range.clone()]) {
                let at = range.start + j;
                new_items.push((self.hashes[at], self.items.json(at)));
            }
        }
        self.claims.all_claimed();
        // The body holds everything but the items: model, tools, sampling.
        let params_hash = self.params;
        if state.store.claim_item(&params_hash) {
            let mut params = (*self.body).clone();
            Tools::restore(self.tools.as_ref(), &mut params);
            new_items.push((params_hash, params.to_string()));
        }
        let response_hashes: Vec<ItemHash> = outcome.response_items.iter().map(item_hash).collect();
        for (h, item) in response_hashes.iter().zip(&outcome.response_items) {
            if state.store.claim_item(h) {
                new_items.push((*h, item.to_string()));
            }
        }
        let complete = !outcome.partial && (200..300).contains(&outcome.status);
        ExchangeRecord {
            id: self.id,
            conversation: self.ident.conversation.clone(),
            new_conversation: self.ident.is_new,
            explicit_key: self.explicit_key.clone(),
            tenant: self.tenant.clone(),
            api: self.api,
            model: self.model.clone(),
            prefix: self.ident.prefix,
            suffix_items: self.hashes[suffix_from.min(self.hashes.len())..].to_vec(),
            request_len: self.hashes.len(),
            params: params_hash,
            response_items: response_hashes.clone(),
            new_items,
            response_id: outcome.response_id,
            usage: outcome.usage,
            status: outcome.status,
            streamed: self.streamed,
            partial: outcome.partial,
            error: outcome.error.map(|e| {
                let redacted = state.upstream.redact(&e, &self.auth).into_owned();
                truncate(redacted, MAX_ERROR_CHARS)
            }),
            started_ms: self.started_ms,
            latency_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            ttfb_ms: outcome.ttfb_ms,
            chain_request: (!self.hashes.is_empty()).then_some(self.chain_request),
            // Only a complete answer can be continued by the next request.
            chain_full: (complete && !response_hashes.is_empty())
                .then(|| chain_extend(self.chain_request, &response_hashes)),
            compaction: self.compaction.as_ref().map(|c| c.id.clone()),
            window: {
                let (limits, source) = state.model_window(&self.model);
                Some(RecordedWindow {
                    tokens: limits.context_window,
                    source,
                })
            },
            client_ids: self.client_ids.clone(),
            client: self.client.clone(),
            preview: self.ident.is_new.then(|| self.preview(state)).flatten(),
            savings: self.savings(state),
        }
    }

    /// What the compaction applied saved, or the would-be one would have,
    /// in the upstream's tokens (the estimate scaled by what it reported
    /// for this conversation).
    fn savings(&self, state: &AppState) -> ExchangeSavings {
        let calibration = state
            .compactions
            .calibration(&self.tenant, &self.ident.conversation);
        let upstream = |c: &Arc<Compaction>| (c.saved() as f64 * calibration) as u64;
        ExchangeSavings {
            mode: self.mode,
            tokens_saved: self.compaction.as_ref().map(upstream).unwrap_or(0),
            tokens_saved_potential: self.observed.as_ref().map(upstream).unwrap_or(0),
            observed_compaction: self.observed.as_ref().map(|c| c.id.clone()),
            recall_rounds: self.recall_spent.rounds,
            recall_input_tokens: self.recall_spent.input_tokens,
            recall_output_tokens: self.recall_spent.output_tokens,
        }
    }

    /// Its first user message, redacted and cut short, to tell the
    /// conversation it opens from others. Codex opens with context blocks
    /// sent as user messages (`<environment_context>…`): a message of the
    /// person's own after them is the one shown.
    fn preview(&self, state: &AppState) -> Option<String> {
        let mut first: Option<String> = None;
        for i in 0..self.items.len().min(PREVIEW_SCAN) {
            let item = self.items.item(i);
            if !items::is_user_message(&item) {
                continue;
            }
            let text = items::text_of(&item);
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            // Cut before redacting (a pasted file may be long), and again
            // after: a credential cut in two at the first cut is gone by
            // the second.
            let cut = bounded_text(text, 4 * MAX_PREVIEW_CHARS);
            let shown = bounded_text(&state.upstream.redact(&cut, &self.auth), MAX_PREVIEW_CHARS);
            if !(text.starts_with('<') && text.ends_with('>')) {
                return Some(shown);
            }
            first.get_or_insert(shown);
        }
        first
    }

    /// Records the exchange (waiting for the commit), indexes it, and logs
    /// the accounting line in the background. False when the answer must
    /// not reach the client: a store shared by replicas could not commit it
    /// (released, it would be an answer no replica knows of).
    pub async fn finish(&self, state: &Arc<AppState>, outcome: Outcome) -> bool {
        // The provider compacted in this answer (a client that asked it to).
        if outcome
            .response_items
            .iter()
            .any(crate::compaction::boundary::is_provider_item)
        {
            state.metrics.provider_compaction();
        }
        let rec = self.to_record(state, outcome);
        observe(state, &rec);
        self.record_on_span(&rec);
        let indexed = indexed(&rec);
        let usage = rec.usage;
        let potential = rec.savings.tokens_saved_potential;
        let status = rec.status;
        let complete = !rec.partial && (200..300).contains(&rec.status);
        if complete {
            state.upstream_reached();
        }
        let recorded = match state.store.record(rec).await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, exchange = self.id, "exchange not recorded");
                false
            }
        };
        state.conversations.remember(&indexed);
        // With reported usage the decision needs no tokenizer: take it now,
        // before the answer's last bytes are released, so a client that
        // sends its next request at once finds the compaction under way.
        // In observe mode the decision is taken on the size the request
        // would have had, as it would be in auto mode.
        // A client's own compaction request starts none of the proxy's.
        let decides = self.mode != Mode::Off && !self.client_compaction;
        if let (true, Some(u), true) = (complete, usage, decides) {
            let used = u.total().saturating_sub(potential);
            engine::after_exchange(state, self.input(String::new(), false), used, false);
        }
        self.account(state, usage, status, complete);
        recorded || !state.store.is_shared()
    }

    /// Records without waiting (the client is gone; nothing can wait).
    pub fn finish_detached(&self, state: &Arc<AppState>, outcome: Outcome) {
        let rec = self.to_record(state, outcome);
        observe(state, &rec);
        state.conversations.remember(&indexed(&rec));
        state.store.record_detached(rec);
    }

    /// The per-exchange accounting line: reported usage, estimate by
    /// section of what was sent, fraction of the model's window, whether
    /// past `warn_ratio`. Then the compaction decision for the next request.
    fn account(&self, state: &Arc<AppState>, usage: Option<Usage>, status: u16, complete: bool) {
        let background = state.background;
        let state = state.clone();
        let (api, tools, view) = (self.api, self.tools.clone(), self.view.clone());
        // The request's own hashes and chains, unless a compaction changed
        // what was sent.
        let sent_as_received = Arc::ptr_eq(&self.view, &self.items);
        let hashes = sent_as_received.then(|| self.hashes.clone());
        let chains = sent_as_received.then(|| self.chains.clone());
        // Without reported usage the estimate decides (only a complete
        // answer says how large the conversation now is).
        let next =
            (complete && usage.is_none() && self.mode != Mode::Off && !self.client_compaction)
                .then(|| self.input(String::new(), false));
        let potential = self.observed.as_deref().map(Compaction::saved).unwrap_or(0);
        let (conversation, model, id) =
            (self.ident.conversation.clone(), self.model.clone(), self.id);
        let tenant = self.tenant.clone();
        let compaction = self.compaction.as_ref().map(|c| c.id.clone());
        background.spawn(move || {
            let hashes = hashes.unwrap_or_else(|| Arc::new(view.hashes()));
            // The provider reads from its newest compaction item on, and so
            // does its reported usage: the estimate counts the same.
            let (view, hashes, chains) = match crate::compaction::boundary::newest_in(&view) {
                Some(b) if b > 0 && hashes.len() == view.len() => (
                    Arc::new(view.with_prefix_replaced(b, &[])),
                    Arc::new(hashes[b..].to_vec()),
                    None,
                ),
                _ => (view, hashes, chains),
            };
            let est = state.tokens.estimate_chained(
                api,
                &view,
                &hashes,
                chains.as_deref().map(Vec::as_slice),
                tools.as_ref(),
            );
            let limits = state.model_limits(&model);
            let (used, source) = match usage {
                Some(u) => (u.total(), "reported"),
                None => (est.total(), "estimate"),
            };
            if let Some(u) = usage {
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
                est_system = est.system, est_messages = est.messages,
                est_tool_outputs = est.tool_outputs, est_tool_definitions = est.tool_definitions,
                window = limits.context_window, fraction = format!("{fraction:.3}"),
                past_warn_ratio,
                "exchange"
            );
            if let Some(input) = next {
                engine::after_exchange(&state, input, used.saturating_sub(potential), true);
            }
        });
    }
}

impl PendingExchange {
    fn record_on_span(&self, rec: &ExchangeRecord) {
        if let Some(u) = rec.usage {
            self.span.record("input_tokens", u.input_tokens);
            self.span.record("output_tokens", u.output_tokens);
        }
        if let Some(c) = &rec.compaction {
            self.span.record("compaction", c.as_str());
        }
    }
}

/// Latency figures and input tokens of a finished exchange, for `/metrics`.
fn observe(state: &AppState, rec: &ExchangeRecord) {
    if let Some(u) = rec.usage {
        let s = &rec.savings;
        let cached = u.cached_tokens.unwrap_or(0);
        state.metrics.exchange_input(
            u.input_tokens,
            cached,
            s.tokens_saved,
            s.tokens_saved_potential,
        );
    }
    state.metrics.upstream_latency(rec.latency_ms / 1000.0);
    if let Some(t) = rec.ttfb_ms {
        state.metrics.ttfb(t / 1000.0);
    }
}

fn indexed(rec: &ExchangeRecord) -> IndexedExchange {
    IndexedExchange {
        id: rec.id,
        conversation: rec.conversation.clone(),
        tenant: rec.tenant.clone(),
        request_len: rec.request_len,
        response_len: rec.response_items.len(),
        chain_request: rec.chain_request,
        chain_full: rec.chain_full,
        response_id: rec.response_id.clone(),
        prefix_exchange: rec.prefix.map(|p| p.exchange),
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        s.truncate(crate::compaction::items::floor_boundary(&s, max));
        s.push('…');
    }
    s
}
