//! Records read back, written once for both backends over [`Sql`]:
//! compactions, learned windows, an exchange's request items (following its
//! prefix references) and item bodies. The views and SQLite's point reads
//! use them; PostgreSQL's request path has async reads of its own.

use super::error::StoreError;
use super::sql::{Dialect, Row, Sql};
use crate::compaction::{Compaction, Rung, SummaryCache};
use crate::windows::{Source, Told};
use crate::wire::ItemHash;

/// Every window upstreams told, by upstream and model.
pub fn load_windows(conn: &dyn Sql) -> Result<Vec<Told>, StoreError> {
    // `window` is a keyword to PostgreSQL.
    conn.rows(
        r#"SELECT upstream, model, "window", source, updated_ms FROM windows
           ORDER BY upstream, model"#,
        &[],
    )?
    .iter()
    .map(|r| {
        let source: String = r.get(3)?;
        Ok(Told {
            upstream: r.get(0)?,
            model: r.get(1)?,
            window: r.count(2)?,
            source: Source::parse(&source).unwrap_or(Source::Learned),
            updated_ms: r.get(4)?,
        })
    })
    .collect()
}

/// The columns [`compaction`] reads, in its order.
pub(super) const COMPACTION_COLUMNS: &str =
    "id, tenant, conversation_id, covered_len, covered_chain,
    replacement, rung, reason, tokens_before, tokens_after, items_removed, items_kept, summary,
    facts, base_id, summary_calls, duration_ms, created_ms, summary_tokens, summary_output_tokens,
    tokens_saved, observed, audit, summary_cached_tokens, summary_cache_write_tokens,
    summary_cache_write_1h_tokens";

/// A compaction from a row of [`COMPACTION_COLUMNS`].
pub(super) fn compaction(r: &Row) -> Result<Compaction, StoreError> {
    let replacement: String = r.get(5)?;
    let facts: Option<String> = r.get(13)?;
    let rung: String = r.get(6)?;
    let chain: Option<Vec<u8>> = r.get(4)?;
    Ok(Compaction {
        id: r.get(0)?,
        tenant: r.get(1)?,
        conversation: r.get(2)?,
        covered_len: r.count(3)? as usize,
        covered_chain: chain
            .and_then(|b| unpack_hashes(&b).into_iter().next())
            .unwrap_or([0; 32]),
        replacement: serde_json::from_str(&replacement).unwrap_or_default(),
        rung: Rung::parse(&rung).unwrap_or(Rung::Fallback),
        reason: r.get(7)?,
        tokens_before: r.count(8)?,
        tokens_after: r.count(9)?,
        items_removed: r.count(10)? as usize,
        items_kept: r.count(11)? as usize,
        summary: r.get(12)?,
        facts: facts.and_then(|f| serde_json::from_str(&f).ok()),
        base: r.get(14)?,
        summary_calls: r.get(15)?,
        duration_ms: r.count(16)?,
        created_ms: r.get(17)?,
        made: Default::default(),
        summary_tokens: r.count(18)?,
        summary_output_tokens: r.count(19)?,
        tokens_saved: r.count(20)?,
        observed: r.get(21)?,
        audit: r
            .get::<Option<String>>(22)?
            .and_then(|a| serde_json::from_str(&a).ok()),
        summary_cache: SummaryCache {
            read: r.count(23)?,
            write: r.count(24)?,
            write_1h: r.count(25)?,
        },
    })
}

/// Compactions, oldest first (in the order stored, among those of one
/// millisecond); all of them or one conversation's.
pub fn load_compactions(
    conn: &dyn Sql,
    conversation: Option<&str>,
) -> Result<Vec<Compaction>, StoreError> {
    let stored_order = match conn.dialect() {
        Dialect::Sqlite => "rowid",
        // No insertion order to read back: ids break the ties.
        Dialect::Postgres => "id",
    };
    conn.rows(
        &format!(
            "SELECT {COMPACTION_COLUMNS} FROM compactions
             WHERE CAST(?1 AS TEXT) IS NULL OR conversation_id = ?1
             ORDER BY created_ms, {stored_order}"
        ),
        &[conversation.into()],
    )?
    .iter()
    .map(compaction)
    .collect()
}

/// One compaction by id.
pub fn load_compaction(conn: &dyn Sql, id: &str) -> Result<Option<Compaction>, StoreError> {
    conn.first(
        &format!("SELECT {COMPACTION_COLUMNS} FROM compactions WHERE id = ?1"),
        &[id.into()],
    )?
    .as_ref()
    .map(compaction)
    .transpose()
}

/// Reconstructs the request items of exchange `id` (as hashes) by following
/// its prefix references back.
pub fn request_item_hashes(conn: &dyn Sql, id: i64) -> Result<Vec<ItemHash>, StoreError> {
    // Collect the chain of references newest-first, then rebuild oldest-first.
    let mut chain: Vec<Link> = Vec::new();
    let mut cur = Some(id);
    while let Some(eid) = cur {
        let row = conn
            .first(
                "SELECT prefix_exchange, prefix_len, prefix_full, suffix_items, response_items
                 FROM exchanges WHERE id = ?1",
                &[eid.into()],
            )?
            .ok_or(StoreError::MissingExchange(eid))?;
        cur = row.get(0)?;
        chain.push((
            cur,
            row.count(1)? as usize,
            row.get(2)?,
            unpack_hashes(&row.get::<Vec<u8>>(3)?),
            unpack_hashes(&row.get::<Vec<u8>>(4)?),
        ));
    }
    chain.reverse();
    Ok(rebuild_items(chain))
}

/// The stored body of an item.
pub fn item_body(conn: &dyn Sql, hash: &ItemHash) -> Result<Option<String>, StoreError> {
    conn.first(
        "SELECT body FROM items WHERE hash = ?1",
        &[hash.as_slice().into()],
    )?
    .map(|r| r.get(0))
    .transpose()
}

/// The whole history a recorded response continued, for expanding a
/// `previous_response_id`: the request's items (without the instructions
/// pseudo-item; instructions are not carried over) followed by the
/// response's output items. Only the tenant's own responses are found.
pub fn response_history(
    conn: &dyn Sql,
    tenant: &str,
    response_id: &str,
) -> Result<Option<Vec<serde_json::Value>>, StoreError> {
    let Some(row) = conn.first(
        "SELECT id, response_items FROM exchanges
         WHERE tenant = ?1 AND response_id = ?2 AND status BETWEEN 200 AND 299 AND NOT partial
         ORDER BY id DESC LIMIT 1",
        &[tenant.into(), response_id.into()],
    )?
    else {
        return Ok(None);
    };
    let mut hashes = request_item_hashes(conn, row.get(0)?)?;
    hashes.extend(unpack_hashes(&row.get::<Vec<u8>>(1)?));
    let mut items = Vec::with_capacity(hashes.len());
    for h in &hashes {
        let Some(body) = item_body(conn, h)? else {
            return Ok(None);
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else {
            return Ok(None);
        };
        if !crate::wire::responses::is_instructions_item(&v) {
            items.push(v);
        }
    }
    Ok(Some(items))
}

/// Concatenates hashes into one blob.
pub fn pack_hashes(hashes: &[ItemHash]) -> &[u8] {
    hashes.as_flattened()
}

/// Splits a blob of concatenated hashes.
pub fn unpack_hashes(blob: &[u8]) -> Vec<ItemHash> {
    blob.chunks_exact(32)
        .map(|c| {
            let mut h = [0u8; 32];
            h.copy_from_slice(c);
            h
        })
        .collect()
}

/// One exchange's reference to the one it continues: (prefix exchange,
/// prefix length, prefix includes its response, suffix, response).
pub(crate) type Link = (Option<i64>, usize, bool, Vec<ItemHash>, Vec<ItemHash>);

/// The request items of the last of `chain` (oldest first, each link
/// continuing the one before it).
pub(crate) fn rebuild_items(chain: Vec<Link>) -> Vec<ItemHash> {
    let mut items: Vec<ItemHash> = Vec::new();
    let mut prev_response: Vec<ItemHash> = Vec::new();
    for (prefix, len, full, suffix, response) in chain {
        if prefix.is_some() {
            if full {
                items.extend(prev_response.iter().copied());
            }
            items.truncate(len);
        } else {
            items.clear();
        }
        items.extend(suffix);
        prev_response = response;
    }
    items
}
