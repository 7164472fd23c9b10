//! Phase 3, send: the provider refused its own compaction item (expired,
//! or no longer readable), so the request is rebuilt from the record and
//! compacted locally (`compaction::rebuild`, `engine::rebuild`), to be sent
//! again in the same request. Called from `send::send` on an error answer
//! (or a Responses stream that failed before any output); it must not send
//! the request or answer the client.

use std::sync::Arc;

use super::exchange::PendingExchange;
use crate::app::AppState;
use crate::compaction::{boundary, rebuild};
use crate::engine;

/// How the upstream refused an encrypted item it can no longer read, when
/// it did: `status` and `body` of an error answer, or (`status` `None`) the
/// data of a Responses stream's failure event before any output. Only in a
/// mode that rewrites requests, when the client's items hold a provider
/// compaction item; `None` otherwise.
pub(super) fn refusal(
    pending: &PendingExchange,
    status: Option<http::StatusCode>,
    body: &[u8],
) -> Option<String> {
    if !pending.mode.rewrites() || boundary::newest_in(&pending.items).is_none() {
        return None;
    }
    match status {
        Some(status) if rebuild::refuses_encrypted_item(pending.api, status.as_u16(), body) => {
            Some(status.to_string())
        }
        None if pending.api == crate::wire::Api::Responses
            && rebuild::stream_refuses_encrypted_item(body) =>
        {
            Some("its stream failed".to_string())
        }
        _ => None,
    }
}

/// Rebuilds the request the upstream refused (`how`: see [`refusal`]): the
/// client's items through their newest provider compaction item are
/// replaced by the history the record holds for it, which is then
/// compacted locally. True when the request is to be sent again; false
/// leaves it as it was (the record does not hold what the item stood for),
/// and the answer goes to the client as it came.
pub(super) async fn rebuilt(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    how: String,
) -> bool {
    // The exchange that answered with the item may still be on its way to
    // the database.
    if let Err(e) = state.store.flush().await {
        tracing::debug!(error = %e, "store flush before a rebuild");
    }
    let items = pending.items.values().to_vec();
    let found = engine::rebuild::from_record(
        state.reads.clone(),
        pending.tenant.clone(),
        pending.ident.conversation.clone(),
        items,
    )
    .await;
    let Some((covered_len, history)) = found else {
        tracing::warn!(
            "the provider refused its compaction item and the record does not hold what it stood for: its answer is relayed"
        );
        return false;
    };
    let Some(&covered_chain) = pending.chains.get(covered_len - 1) else {
        return false;
    };
    let restored = history.len();
    let base = rebuild::standing_for(
        &pending.tenant,
        &pending.ident.conversation,
        covered_len,
        covered_chain,
        history,
    );
    pending.unapply();
    pending.apply(Arc::new(base));
    let reason = format!(
        "{}: the provider refused its compaction item ({how}); {restored} items it stood for rebuilt from the record",
        rebuild::REBUILD_REASON
    );
    let compacted =
        super::identify::compact_now(state, pending, reason, engine::Goal::Shrink).await;
    if compacted {
        // The upstream refused the request and the proxy compacted it to
        // go again: the reactive path's trigger.
        state.metrics.compaction_trigger("reactive");
    }
    tracing::info!(
        conversation = %pending.ident.conversation,
        covered = covered_len,
        restored,
        compacted,
        "the provider refused its compaction item: the conversation was rebuilt from the record and is sent again"
    );
    true
}
