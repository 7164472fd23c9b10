//! The admin API's handlers: the store's reads ([`crate::store::Queries`],
//! through the backend's own read path, never the writer thread) on a
//! blocking thread, and manual compaction.

use std::sync::Arc;

use http::{Response, StatusCode};
use serde::Serialize;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody, ProxyError};
use crate::store::query::QueryError;
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
            .map_err(|e| ProxyError::Internal(e.to_string()))
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

/// The store could not be read: the detail is logged, not shown.
fn store_unavailable(e: impl std::fmt::Display) -> ProxyError {
    ProxyError::StoreUnavailable(e.to_string())
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
    let resolved = read(state.clone(), move |reads, _| {
        reads.resolve_conversation(&id)
    })
    .await;
    let id = match resolved {
        Ok(id) => id,
        Err(e) => return e.into_response(),
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
