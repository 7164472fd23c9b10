//! The record's side of rebuilding a conversation whose provider
//! compaction item the provider refuses (`compaction::rebuild`): the
//! exchange whose answer carried the item, and the input it was sent,
//! read from the store.
//!
//! The exchange is looked for among the conversation's recorded exchanges,
//! newest first, then among the tenant's (a client that dropped what came
//! before the item may be named a new conversation); at most
//! [`RECENT_EXCHANGES`] of each, so a refusal costs a bounded read.

use std::sync::Arc;

use serde_json::Value;

use crate::compaction::rebuild;
use crate::store::rows::{item_body, request_item_hashes, unpack_hashes};
use crate::store::sql::Sql;
use crate::store::Reads;
use crate::wire::{item_hash, responses, ItemHash};

/// Most recorded exchanges looked through for the one that answered with
/// an item, in the conversation and then in the tenant.
pub const RECENT_EXCHANGES: i64 = 1000;

/// What replaces the client's `items` up to their newest provider
/// compaction item, from the record (see [`rebuild::rebuild`]): `None` when
/// the record does not hold it all, or the store cannot be read.
pub async fn from_record(
    reads: Arc<dyn Reads>,
    tenant: String,
    conversation: String,
    items: Vec<Value>,
) -> Option<(usize, Vec<Value>)> {
    tokio::task::spawn_blocking(move || {
        let conn = match reads.views() {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "the record could not be read to rebuild the conversation");
                return None;
            }
        };
        let mut history_of = |item: &Value| match history_of(&*conn, &tenant, &conversation, item)
        {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "the record could not be read to rebuild the conversation");
                None
            }
        };
        rebuild::rebuild(&items, &mut history_of)
    })
    .await
    .ok()
    .flatten()
}

/// The recorded input of the tenant's exchange whose answer carried `item`
/// (its `instructions` pseudo-item left out: the request carries its own).
fn history_of(
    conn: &dyn Sql,
    tenant: &str,
    conversation: &str,
    item: &Value,
) -> Result<Option<Vec<Value>>, crate::store::StoreError> {
    let hash = item_hash(item);
    let in_conversation = producer(
        conn,
        "SELECT id, response_items FROM exchanges
         WHERE tenant = ?1 AND conversation_id = ?2 AND status BETWEEN 200 AND 299
         ORDER BY id DESC LIMIT ?3",
        &[tenant.into(), conversation.into(), RECENT_EXCHANGES.into()],
        &hash,
    )?;
    let found = match in_conversation {
        Some(id) => Some(id),
        None => producer(
            conn,
            "SELECT id, response_items FROM exchanges
             WHERE tenant = ?1 AND status BETWEEN 200 AND 299
             ORDER BY id DESC LIMIT ?2",
            &[tenant.into(), RECENT_EXCHANGES.into()],
            &hash,
        )?,
    };
    let Some(id) = found else {
        return Ok(None);
    };
    let mut items = Vec::new();
    for h in request_item_hashes(conn, id)? {
        let Some(body) = item_body(conn, &h)? else {
            return Ok(None);
        };
        let Ok(v) = serde_json::from_str::<Value>(&body) else {
            return Ok(None);
        };
        if !responses::is_instructions_item(&v) {
            items.push(v);
        }
    }
    Ok(Some(items))
}

/// The first exchange `sql` lists (id, response items) whose answer holds
/// the item hashed `hash`.
fn producer(
    conn: &dyn Sql,
    sql: &str,
    params: &[crate::store::sql::Param<'_>],
    hash: &ItemHash,
) -> Result<Option<i64>, crate::store::StoreError> {
    for row in conn.rows(sql, params)? {
        let answered: Vec<u8> = row.get(1)?;
        if unpack_hashes(&answered).contains(hash) {
            return Ok(Some(row.get(0)?));
        }
    }
    Ok(None)
}
