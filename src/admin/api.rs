//! The admin API's handlers: store reads on a blocking thread with their own
//! read-only connection (never the writer thread's), and manual compaction.

use std::sync::Arc;

use http::{Response, StatusCode};
use serde::Serialize;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody, ProxyError};
use crate::store::query::{self, QueryError};

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

/// `GET /admin/api/savings`: what compaction saved, per conversation, per
/// tenant and in total (see [`crate::store::savings`]).
pub async fn savings(state: Arc<AppState>) -> Response<ProxyBody> {
    read(state, move |conn, st| {
        Ok(crate::store::savings::report(conn, &st.config, None)?)
    })
    .await
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
            "message": "the conversation's next Chat Completions request will be compacted before it goes upstream",
        }),
    )
}
