//! The admin API's handlers: store reads on a blocking thread with their own
//! read-only connection (never the writer thread's), and manual compaction.

use std::sync::Arc;

use http::{Response, StatusCode};
use serde::Serialize;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody, ProxyError};
use crate::store::query::{self, QueryError};
use crate::store::retention::{self, Removed};
use crate::store::StoreError;

/// Conversations listed when the request names no `limit`.
pub const DEFAULT_LIMIT: usize = 200;

/// Runs `f` over a fresh read-only connection on a blocking thread and
/// renders its result (or the error) as JSON.
async fn read<T, F>(state: Arc<AppState>, f: F) -> Response<ProxyBody>
where
    T: Serialize + Send + 'static,
    F: FnOnce(&rusqlite::Connection, &AppState) -> Result<T, QueryError> + Send + 'static,
{
    // Up to the last exchange relayed.
    if let Err(e) = state.store.flush().await {
        return internal(&e.to_string());
    }
    let result = tokio::task::spawn_blocking(move || {
        let conn = query::open_read_only(&state.config.store_path())?;
        f(&conn, &state)
    })
    .await;
    match result {
        Ok(Ok(value)) => match serde_json::to_value(&value) {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(e) => internal(&e.to_string()),
        },
        Ok(Err(e)) => query_error(&e),
        Err(e) => internal(&e.to_string()),
    }
}

fn query_error(e: &QueryError) -> Response<ProxyBody> {
    match e {
        QueryError::NotFound(_) => ProxyError::ConversationNotFound(e.to_string()),
        QueryError::Ambiguous(..) => ProxyError::ConversationAmbiguous(e.to_string()),
        QueryError::Store(s) => ProxyError::StoreUnavailable(s.to_string()),
    }
    .into_response()
}

fn internal(detail: &str) -> Response<ProxyBody> {
    ProxyError::StoreUnavailable(detail.to_string()).into_response()
}

/// `GET /admin/api/conversations`
pub async fn list(state: Arc<AppState>, limit: usize) -> Response<ProxyBody> {
    read(state, move |conn, st| {
        let conversations = query::list_conversations(conn, &st.config, limit)?;
        Ok(serde_json::json!({ "conversations": conversations }))
    })
    .await
}

/// `GET /admin/api/conversations/ID`
pub async fn show(state: Arc<AppState>, id: String) -> Response<ProxyBody> {
    read(state, move |conn, st| query::show(conn, &st.config, &id)).await
}

/// `GET /admin/api/conversations/ID/export`
pub async fn export(state: Arc<AppState>, id: String) -> Response<ProxyBody> {
    read(state, move |conn, st| query::export(conn, &st.config, &id)).await
}

/// `POST /admin/api/conversations/ID/compact`: the conversation's next
/// request is compacted (it carries the credentials the summary needs).
pub async fn compact(state: Arc<AppState>, id: String) -> Response<ProxyBody> {
    if let Err(e) = state.store.flush().await {
        return internal(&e.to_string());
    }
    let st = state.clone();
    let resolved = tokio::task::spawn_blocking(move || {
        let conn = query::open_read_only(&st.config.store_path())?;
        query::resolve_id(&conn, &id)
    })
    .await;
    let id = match resolved {
        Ok(Ok(id)) => id,
        Ok(Err(e)) => return query_error(&e),
        Err(e) => return internal(&e.to_string()),
    };
    let newly = state.compactions.request_manual(&id);
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
async fn named(state: &Arc<AppState>, name: String) -> Result<(String, String), QueryError> {
    let found = victims(state, move |conn| {
        let id = query::resolve_id(conn, &name)?;
        let tenant = retention::tenant_of(conn, &id)?.ok_or(QueryError::NotFound(id.clone()))?;
        Ok(vec![(tenant, id)])
    })
    .await?;
    found
        .into_iter()
        .next()
        .map(|(tenant, id, _)| (tenant, id))
        .ok_or_else(|| QueryError::NotFound(String::new()))
}

/// `GET /admin/api/conversations/ID/compact`: the outcome of its latest
/// compaction attempt (`null` before any), and whether one is requested.
pub async fn compact_status(state: Arc<AppState>, name: String) -> Response<ProxyBody> {
    match named(&state, name).await {
        Ok((tenant, id)) => {
            let outcome = state.compactions.attempts(&tenant, &id).pop();
            json_response(
                StatusCode::OK,
                &serde_json::json!({
                    "conversation": id,
                    "pending": state.compactions.manual_pending(&id),
                    "outcome": outcome,
                }),
            )
        }
        Err(e) => query_error(&e),
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
        Err(e) => query_error(&e),
    }
}

/// Conversations one retention pass deletes at most; the next pass goes on.
pub const MAX_DELETED_PER_PASS: usize = 10_000;

/// A conversation to delete: (tenant, id, its compactions).
type Victim = (String, String, Vec<String>);

/// Deletes conversations while the proxy serves: first forgotten in
/// memory (no new request is taken as theirs, none of their compactions
/// applies), then what was recorded is flushed, the known items forgotten
/// (items may go), and the store maintained on a connection of its own.
async fn remove(state: &Arc<AppState>, victims: Vec<Victim>) -> Result<Removed, QueryError> {
    for (tenant, id, compactions) in &victims {
        state.conversations.forget(tenant, id);
        state.compactions.forget(tenant, compactions);
    }
    state.store.flush().await?;
    state.store.forget_known_items();
    let path = state.config.store_path();
    let ids: Vec<String> = victims.into_iter().map(|(_, id, _)| id).collect();
    tokio::task::spawn_blocking(move || {
        let mut conn = retention::open_for_maintenance(&path)?;
        Ok(retention::delete_and_prune(&mut conn, &ids)?)
    })
    .await
    .map_err(|e| QueryError::Store(StoreError::Io(std::io::Error::other(e.to_string()))))?
}

/// The conversations `find` names, with what [`remove`] needs of each.
async fn victims<F>(state: &Arc<AppState>, find: F) -> Result<Vec<Victim>, QueryError>
where
    F: FnOnce(&rusqlite::Connection) -> Result<Vec<(String, String)>, QueryError> + Send + 'static,
{
    state.store.flush().await?;
    let path = state.config.store_path();
    tokio::task::spawn_blocking(move || {
        let conn = query::open_read_only(&path)?;
        find(&conn)?
            .into_iter()
            .map(|(tenant, id)| {
                let compactions = retention::compactions_of(&conn, &id)?;
                Ok((tenant, id, compactions))
            })
            .collect()
    })
    .await
    .map_err(|e| QueryError::Store(StoreError::Io(std::io::Error::other(e.to_string()))))?
}

/// Deletes the conversations last seen before `cutoff_ms` (at most
/// [`MAX_DELETED_PER_PASS`]), then the items nothing refers to.
pub async fn retain(state: &Arc<AppState>, cutoff_ms: i64) -> Result<Removed, QueryError> {
    let found = victims(state, move |conn| {
        Ok(retention::seen_before(
            conn,
            cutoff_ms,
            MAX_DELETED_PER_PASS,
        )?)
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
    let found = victims(&state, move |conn| {
        let id = query::resolve_id(conn, &name)?;
        let tenant = retention::tenant_of(conn, &id)?.ok_or(QueryError::NotFound(id.clone()))?;
        Ok(vec![(tenant, id)])
    })
    .await;
    let found = match found {
        Ok(f) => f,
        Err(e) => return query_error(&e),
    };
    let id = found.first().map(|v| v.1.clone()).unwrap_or_default();
    match remove(&state, found).await {
        Ok(r) => {
            tracing::info!(conversation = %id, exchanges = r.exchanges, items = r.items, "conversation deleted");
            removed(r, serde_json::json!({ "conversation": id }))
        }
        Err(e) => query_error(&e),
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
        Err(e) => query_error(&e),
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
