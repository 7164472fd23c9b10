//! Compaction on request: a compaction made while the request waits, for
//! the decisions the phases leave to the driver in `server::proxy` (over
//! the hard limit at identify, a manual or client-asked compaction, an
//! upstream "too long", a compacted request refused whose summary was the
//! provider's, the provider's own compaction item refused). Each computes the compaction and applies it to the
//! exchange; none sends, answers or records. The driver calls it, and, as
//! a phase, it calls no other.

use std::sync::Arc;

use serde_json::Value;

use super::exchange::PendingExchange;
use crate::app::AppState;
use crate::compaction::{policy, rebuild};
use crate::config::Mode;
use crate::engine;

/// Computes a compaction of the request's view now, to reach `goal`, and
/// applies it.
pub(super) async fn compact_now(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    reason: String,
    goal: engine::Goal,
) -> bool {
    let mut input = pending.input(reason, false);
    input.ask.goal = goal;
    match engine::compact(state, input).await {
        Ok(c) => {
            pending.apply(c);
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "no compaction could be applied");
            false
        }
    }
}

/// The upstream refused the request as too long: remembers the window it
/// stated, and compacts the request to fit it.
pub(super) async fn compact_on_overflow(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    stated: policy::Stated,
    why: &str,
) -> bool {
    if let Some(window) = stated.limit {
        super::discovery::tell(
            state,
            pending.request().model(),
            window,
            crate::windows::Source::Learned,
        )
        .await;
    }
    let max_output = request_max_output(pending.request().body());
    let goal = engine::Goal::Overflow { stated, max_output };
    compact_now(state, pending, format!("overflow: {why}"), goal).await
}

/// The largest answer the request asks for, if it sets one (Chat's
/// `max_tokens` / `max_completion_tokens`, Responses' `max_output_tokens`).
fn request_max_output(body: &Value) -> Option<u64> {
    ["max_completion_tokens", "max_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
}

/// A request too large to go out as it is (`tokens`, over the hard limit),
/// and nothing under way: compacted now rather than let the upstream
/// refuse it.
pub(super) async fn hard_limit(state: &Arc<AppState>, pending: &mut PendingExchange, tokens: u64) {
    compact_now(
        state,
        pending,
        format!("hard_limit: ~{tokens} tokens leave no room for the answer"),
        engine::Goal::HardLimit,
    )
    .await;
}

/// A compaction that waited for its boundary, applied to a request over
/// the hard limit, may leave it over still: the items of the turn after it
/// grew while it waited. Then the request is compacted afresh from it, as
/// one with none would be (not in manual mode).
pub(super) async fn fit_after_waiting(state: &Arc<AppState>, pending: &mut PendingExchange) {
    if pending.request().mode() == Mode::Manual {
        return;
    }
    let check = pending.fit_check(None);
    if let engine::Fit::Over(tokens) = engine::check_fit(state, check).await {
        hard_limit(state, pending, tokens).await;
    }
}

/// A compacted request refused whose summary was the provider's
/// (`engine::provider::refused`): compacted again from the client's items
/// with the local summarizer. False when it was no provider compaction, or
/// no local one could be made (the client's items are then what goes).
pub(super) async fn local_instead(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    status: http::StatusCode,
) -> bool {
    let Some(c) = pending.compaction().cloned() else {
        return false;
    };
    if !engine::provider::refused(
        state,
        pending.request().tenant(),
        pending.conversation(),
        &c,
        status,
    ) {
        return false;
    }
    pending.unapply();
    let trigger = c
        .reason
        .trim_end_matches(crate::compaction::provider::PROVIDER_REASON)
        .trim_end_matches("; ");
    let reason = format!("{trigger}; the provider's compaction refused upstream ({status})");
    compact_now(state, pending, reason, engine::Goal::Shrink).await
}

/// Rebuilds the request the upstream refused (`how`: see `send::refusal`): the
/// client's items through their newest provider compaction item are
/// replaced by the history the record holds for it, which is then
/// compacted locally. True when the request is to be sent again; false
/// leaves it as it was (the record does not hold what the item stood for),
/// and the answer goes to the client as it came.
pub(super) async fn rebuild_from_record(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    how: String,
) -> bool {
    // The exchange that answered with the item may still be on its way to
    // the database.
    if let Err(e) = state.store.flush().await {
        tracing::debug!(error = %e, "store flush before a rebuild");
    }
    let items = pending.request().items().values().to_vec();
    let found = engine::rebuild::from_record(
        state.reads.clone(),
        pending.request().tenant().to_string(),
        pending.conversation().to_string(),
        items,
    )
    .await;
    let Some((covered_len, history)) = found else {
        tracing::warn!(
            "the provider refused its compaction item and the record does not hold what it stood for: its answer is relayed"
        );
        return false;
    };
    let Some(&covered_chain) = pending.chains().get(covered_len - 1) else {
        return false;
    };
    let restored = history.len();
    let base = rebuild::standing_for(
        pending.request().tenant(),
        pending.conversation(),
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
    let compacted = compact_now(state, pending, reason, engine::Goal::Shrink).await;
    if compacted {
        // The upstream refused the request and the proxy compacted it to
        // go again: the reactive path's trigger.
        state.metrics.compaction_trigger("reactive");
    }
    tracing::info!(
        conversation = %pending.conversation(),
        covered = covered_len,
        restored,
        compacted,
        "the provider refused its compaction item: the conversation was rebuilt from the record and is sent again"
    );
    true
}
