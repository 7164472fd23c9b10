//! The record phase: runs when the answer is complete, cut short, or
//! refused by the proxy. The driver opens each exchange with it
//! ([`RECORDER`]), and the exchange's end runs it (`PendingExchange::finish`,
//! from the relay, the splice, the compact endpoint or a failure). Builds
//! the record through the exchange, commits it (before the last frame of
//! an answer is released), counts its figures and indexes it, takes the
//! decision on the next compaction, and queues the accounting line. It
//! must not change what the client receives.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::exchange::{Outcome, PendingExchange, Recorder};
use crate::app::AppState;
use crate::engine;
use crate::store::{ExchangeRecord, IndexedExchange};

/// This phase, as the driver hands it to the exchanges it opens.
pub(super) const RECORDER: Recorder = Recorder {
    finish: finish_boxed,
    detached: finish_detached,
};

fn finish_boxed<'a>(
    state: &'a Arc<AppState>,
    pending: &'a PendingExchange,
    outcome: Outcome,
) -> BoxFuture<'a, bool> {
    Box::pin(finish(state, pending, outcome))
}

/// Records the exchange (waiting for the commit), indexes it, and logs
/// the accounting line in the background. False when the answer must
/// not reach the client: a store shared by replicas could not commit it
/// (released, it would be an answer no replica knows of).
async fn finish(state: &Arc<AppState>, pending: &PendingExchange, outcome: Outcome) -> bool {
    // The provider compacted in this answer (a client that asked it to).
    if outcome
        .response_items
        .iter()
        .any(crate::compaction::boundary::is_provider_item)
    {
        state.metrics.provider_compaction();
    }
    // The answer to a client's own compaction request that named no
    // session (Gemini CLI's): the request that goes on from its summary
    // is matched by that text (see `engine::handoff`).
    let request = pending.request();
    let summary = (pending.client_compaction()
        && request.explicit_key().is_none()
        && request.previous().is_none())
    .then(|| outcome.response_items.clone());
    let rec = pending.to_record(state, outcome);
    pending.record_on_span(&rec);
    let usage = rec.usage;
    let potential = rec.savings.tokens_saved_potential;
    let status = rec.status;
    let complete = !rec.partial && (200..300).contains(&rec.status);
    if complete && pending.client_compaction() {
        let (tenant, conversation) = (request.tenant(), pending.conversation());
        state.handoffs.answered(tenant, conversation);
        if let Some(answer) = summary {
            state.handoffs.summarized(tenant, conversation, &answer);
        }
    }
    let recorded = commit(state, rec).await;
    // With reported usage the decision needs no tokenizer: take it now,
    // before the answer's last bytes are released, so a client that
    // sends its next request at once finds the compaction under way.
    // In observe mode the decision is taken on the size the request
    // would have had, as it would be in auto mode.
    if let (true, Some(u), true) = (complete, usage, pending.decides_next()) {
        let used = u.total().saturating_sub(potential);
        engine::after_exchange(state, pending.input(String::new(), false), used, false);
    }
    pending.account(state, usage, status, complete);
    recorded || !state.store.is_shared()
}

/// Records without waiting (the client is gone; nothing can wait).
fn finish_detached(state: &Arc<AppState>, pending: &PendingExchange, outcome: Outcome) {
    let rec = pending.to_record(state, outcome);
    commit_detached(state, rec);
}

/// Commits a finished exchange's record, waiting for the commit, counts
/// its figures and indexes it. False when the store could not commit it.
async fn commit(state: &Arc<AppState>, rec: ExchangeRecord) -> bool {
    observe(state, &rec);
    let indexed = indexed(&rec);
    if !rec.partial && (200..300).contains(&rec.status) {
        state.upstream_reached();
    }
    let id = rec.id;
    let recorded = match state.store.record(rec).await {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(error = %e, exchange = id, "exchange not recorded");
            false
        }
    };
    state.conversations.remember(&indexed);
    recorded
}

/// Commits a record without waiting (the client is gone; nothing can wait).
fn commit_detached(state: &Arc<AppState>, rec: ExchangeRecord) {
    observe(state, &rec);
    state.conversations.remember(&indexed(&rec));
    state.store.record_detached(rec);
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
        let tokens = crate::prices::Tokens {
            input: u.input_tokens,
            cache_read: cached,
            cache_write: u.cache_write_tokens.unwrap_or(0),
            cache_write_1h: u.cache_write_1h_tokens.unwrap_or(0),
            output: u.output_tokens,
        };
        let recall = tokens.resent(s.recall_input_tokens, s.recall_output_tokens);
        let saved = if rec.compaction.is_some() {
            s.tokens_saved
        } else {
            0
        };
        state.metrics.exchange_bill(
            &rec.conversation,
            crate::prices::of(&state.config, &rec.model),
            tokens,
            recall,
            saved,
            rec.started_ms,
            rec.started_ms + rec.latency_ms.max(0.0) as i64,
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
        chain_echoed: rec.chain_echoed,
        response_id: rec.response_id.clone(),
        prefix_exchange: rec.prefix.map(|p| p.exchange),
    }
}
