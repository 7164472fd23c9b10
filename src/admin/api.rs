//! The admin API's handlers: the store's reads ([`crate::store::Queries`],
//! through the backend's own read path, never the writer thread) on a
//! blocking thread, and manual compaction.

use std::sync::Arc;

use http::{Response, StatusCode};
use serde::Serialize;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody, ProxyError};
use crate::store::query::QueryError;
use crate::store::retention::{Removed, Victim};
use crate::store::Reads;

/// Conversations listed when the request names no `limit`.
pub const DEFAULT_LIMIT: usize = 200;

/// Runs `f` over the store's reads on a blocking thread, once the store
/// holds the last exchange relayed.
async fn read<T, F>(state: Arc<AppState>, f: F) -> Result<T, ProxyError>
where
    T: Send + 'static,
    F: FnOnce(&dyn Reads, &AppState) -> Result<T, QueryError> + Send + 'static,
{
    state.store.flush().await.map_err(store_unavailable)?;
    tokio::task::spawn_blocking(move || f(&*state.reads, &state))
        .await
        .map_err(store_unavailable)?
        .map_err(ProxyError::from)
}

/// [`read`], its result as JSON.
async fn read_json<T, F>(state: Arc<AppState>, f: F) -> Response<ProxyBody>
where
    T: Serialize + Send + 'static,
    F: FnOnce(&dyn Reads, &AppState) -> Result<T, QueryError> + Send + 'static,
{
    let answer = read(state, f).await.and_then(|value| {
        serde_json::to_value(&value)
            .map(|v| json_response(StatusCode::OK, &v))
            .map_err(ProxyError::internal)
    });
    answer.unwrap_or_else(ProxyError::into_response)
}

impl From<QueryError> for ProxyError {
    fn from(e: QueryError) -> Self {
        match e {
            QueryError::NotFound(_) => ProxyError::ConversationNotFound(e.to_string()),
            QueryError::Ambiguous(..) => ProxyError::ConversationAmbiguous(e.to_string()),
            QueryError::Store(s) => store_unavailable(s),
        }
    }
}

/// The store could not be read: the cause is logged, not shown.
fn store_unavailable(e: impl Into<crate::error::BoxError>) -> ProxyError {
    ProxyError::store_unavailable(e)
}

/// `GET /admin/api/conversations`
pub async fn list(state: Arc<AppState>, limit: usize) -> Response<ProxyBody> {
    read_json(state, move |reads, st| {
        let conversations = reads.conversations(&st.config, limit)?;
        Ok(serde_json::json!({ "conversations": conversations }))
    })
    .await
}

/// `GET /admin/api/conversations/ID`
pub async fn show(state: Arc<AppState>, id: String) -> Response<ProxyBody> {
    read_json(state, move |reads, st| {
        reads.conversation_detail(&st.config, &id)
    })
    .await
}

/// `GET /admin/api/savings`: what compaction saved, per conversation, per
/// tenant and in total (see [`crate::store::savings`]), and the compaction
/// storms this process held back or saw (`storms`).
pub async fn savings(state: Arc<AppState>) -> Response<ProxyBody> {
    let storms = serde_json::json!({
        "proxy_avoided": state.metrics.storms().storms_avoided(),
        "client_repeats": state.metrics.storms().client_compaction_repeats(),
    });
    let answer = read(state, move |reads, st| reads.savings(&st.config))
        .await
        .and_then(|report| serde_json::to_value(report).map_err(ProxyError::internal))
        .map(|mut report| {
            report["storms"] = storms;
            json_response(StatusCode::OK, &report)
        });
    answer.unwrap_or_else(ProxyError::into_response)
}

/// `GET /admin/api/conversations/ID/export`
pub async fn export(state: Arc<AppState>, id: String) -> Response<ProxyBody> {
    read_json(state, move |reads, st| {
        reads.conversation_export(&st.config, &id)
    })
    .await
}

/// `POST /admin/api/conversations/ID/compact`: the conversation's next
/// request is compacted (it carries the credentials the summary needs).
pub async fn compact(state: Arc<AppState>, id: String) -> Response<ProxyBody> {
    // Recorded in the store when it is shared: whichever replica serves
    // the next request honours it.
    let requested = read(state.clone(), move |reads, st| {
        let id = reads.resolve_conversation(&id)?;
        let newly = st.compactions.request_manual(&id)?;
        Ok((id, newly))
    })
    .await;
    let (id, newly) = match requested {
        Ok(requested) => requested,
        Err(e) => return e.into_response(),
    };
    tracing::info!(conversation = %id, newly, "manual compaction requested");
    json_response(
        StatusCode::ACCEPTED,
        &serde_json::json!({
            "conversation": id,
            "pending": true,
            "already_pending": !newly,
            "requested_ms": crate::ids::now_ms(),
            "message": "the conversation's next request will be compacted before it goes upstream; GET this URL for the outcome",
        }),
    )
}

/// The conversation `name` names, and its tenant.
async fn named(state: &Arc<AppState>, name: String) -> Result<(String, String), ProxyError> {
    let found = read(state.clone(), move |reads, _| reads.victim(&name)).await?;
    Ok((found.tenant, found.id))
}

/// `GET /admin/api/conversations/ID/compact`: the outcome of its latest
/// compaction attempt (`null` before any), and whether one is requested
/// (of any replica, with a shared store).
pub async fn compact_status(state: Arc<AppState>, name: String) -> Response<ProxyBody> {
    let found = read(state.clone(), move |reads, st| {
        let found = reads.victim(&name)?;
        let pending = st.compactions.manual_pending(&found.id)?;
        // Another replica may have compacted it: the stored compaction
        // stands for the attempt this one did not see.
        let stored = match pending || !reads.shared() {
            true => None,
            false => reads.latest_compaction(&found.id)?,
        };
        // Or discarded it (kept in the shared store, not as a compaction).
        let unstored = match pending || !reads.shared() {
            true => None,
            false => reads.latest_attempt(&found.tenant, &found.id),
        };
        Ok((found.tenant, found.id, pending, stored, unstored))
    })
    .await;
    match found {
        Ok((tenant, id, pending, stored, unstored)) => {
            let own = state.compactions.attempts(&tenant, &id).pop();
            let stored = stored.as_ref().map(crate::engine::Attempt::stored);
            let unstored = unstored.as_ref().map(crate::engine::Attempt::shared);
            // The newest, this replica's own first among equals.
            let outcome = [own, stored, unstored]
                .into_iter()
                .flatten()
                .reduce(|a, b| if b.at_ms > a.at_ms { b } else { a });
            json_response(
                StatusCode::OK,
                &serde_json::json!({
                    "conversation": id,
                    "pending": pending,
                    "outcome": outcome,
                }),
            )
        }
        Err(e) => e.into_response(),
    }
}

/// `GET /admin/api/conversations/ID/attempts`: its recent compaction
/// attempts, discarded ones included (kept in memory, since start-up).
pub async fn attempts(state: Arc<AppState>, name: String) -> Response<ProxyBody> {
    match named(&state, name).await {
        Ok((tenant, id)) => json_response(
            StatusCode::OK,
            &serde_json::json!({
                "conversation": id,
                "attempts": state.compactions.attempts(&tenant, &id),
            }),
        ),
        Err(e) => e.into_response(),
    }
}

/// Conversations one retention pass deletes at most; the next pass goes on.
pub const MAX_DELETED_PER_PASS: usize = 10_000;

/// Deletes conversations while the proxy serves: first forgotten in
/// memory (no new request is taken as theirs, none of their compactions
/// applies), then what was recorded is flushed, the known items forgotten
/// (items may go), and the store maintained beside the writer.
async fn remove(state: &Arc<AppState>, victims: Vec<Victim>) -> Result<Removed, ProxyError> {
    for v in &victims {
        state.conversations.forget(&v.tenant, &v.id);
        state.compactions.forget(&v.tenant, &v.compactions);
    }
    state.store.flush().await.map_err(store_unavailable)?;
    state.forget_stored_items();
    let ids: Vec<String> = victims.into_iter().map(|v| v.id).collect();
    let reads = state.reads.clone();
    tokio::task::spawn_blocking(move || reads.delete_conversations(&ids))
        .await
        .map_err(store_unavailable)?
        .map_err(ProxyError::from)
}

/// Deletes the conversations last seen before `cutoff_ms` (at most
/// [`MAX_DELETED_PER_PASS`]), then the items nothing refers to.
pub async fn retain(state: &Arc<AppState>, cutoff_ms: i64) -> Result<Removed, ProxyError> {
    let found = read(state.clone(), move |reads, _| {
        reads.victims_seen_before(cutoff_ms, MAX_DELETED_PER_PASS)
    })
    .await?;
    remove(state, found).await
}

fn removed(removed: Removed, extra: serde_json::Value) -> Response<ProxyBody> {
    let mut body = serde_json::json!({ "removed": removed });
    if let (Some(b), serde_json::Value::Object(more)) = (body.as_object_mut(), extra) {
        b.extend(more);
    }
    json_response(StatusCode::OK, &body)
}

/// `DELETE /admin/api/conversations/ID`: the conversation, its exchanges
/// and compactions, and the items nothing else refers to.
pub async fn delete(state: Arc<AppState>, name: String) -> Response<ProxyBody> {
    let found = match read(state.clone(), move |reads, _| reads.victim(&name)).await {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let id = found.id.clone();
    match remove(&state, vec![found]).await {
        Ok(r) => {
            tracing::info!(conversation = %id, exchanges = r.exchanges, items = r.items, "conversation deleted");
            removed(r, serde_json::json!({ "conversation": id }))
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /admin/api/prune?older_than_secs=N`: conversations last seen
/// longer ago than that, then unreferenced items, then VACUUM.
pub async fn prune(state: Arc<AppState>, older_than_secs: u64) -> Response<ProxyBody> {
    let cutoff = crate::ids::now_ms() - (older_than_secs.min(i64::MAX as u64 / 1000) * 1000) as i64;
    match retain(&state, cutoff).await {
        Ok(r) => {
            tracing::info!(
                conversations = r.conversations,
                items = r.items,
                "store pruned"
            );
            removed(r, serde_json::json!({ "cutoff_ms": cutoff }))
        }
        Err(e) => e.into_response(),
    }
}

/// How often `[store] retain_days` is applied by a running proxy.
pub const RETENTION_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

/// Applies `[store] retain_days` now and every [`RETENTION_EVERY`], in the
/// background, for as long as the proxy runs.
pub async fn retention_loop(state: Arc<AppState>, days: u32) {
    let mut every = tokio::time::interval(RETENTION_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let cutoff = crate::ids::now_ms() - i64::from(days) * 86_400_000;
        match retain(&state, cutoff).await {
            Ok(r) if r != Removed::default() => tracing::info!(
                retain_days = days,
                conversations = r.conversations,
                exchanges = r.exchanges,
                items = r.items,
                "retention applied"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention could not be applied"),
        }
    }
}
