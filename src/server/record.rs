//! Phase 5, record: runs when the answer is complete, cut short, or
//! refused by the proxy, through `PendingExchange::finish` (beside the
//! exchange, which builds the record). Commits the record (before the last
//! frame of an answer is released), counts its figures and indexes it; the
//! exchange then queues the accounting line. It must not change what the
//! client receives.

use std::sync::Arc;

use crate::app::AppState;
use crate::store::{ExchangeRecord, IndexedExchange};

/// Most characters of an upstream error body kept in a record.
const MAX_ERROR_CHARS: usize = 4096;

/// Commits a finished exchange's record, waiting for the commit, counts
/// its figures and indexes it. False when the store could not commit it.
pub(super) async fn commit(state: &Arc<AppState>, rec: ExchangeRecord) -> bool {
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
pub(super) fn commit_detached(state: &Arc<AppState>, rec: ExchangeRecord) {
    observe(state, &rec);
    state.conversations.remember(&indexed(&rec));
    state.store.record_detached(rec);
}

/// What a record keeps of an error: redacted of the client's credentials
/// (`auth`) and the proxy's own, and cut short.
pub(super) fn error_text(state: &AppState, error: &str, auth: &http::HeaderMap) -> String {
    let redacted = state.upstream.redact(error, auth).into_owned();
    truncate(redacted, MAX_ERROR_CHARS)
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

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        s.truncate(crate::compaction::items::floor_boundary(&s, max));
        s.push('…');
    }
    s
}
