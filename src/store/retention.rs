//! Keeping the store tidy: deleting conversations (by name or by age) with
//! their exchanges and compactions, then the items no record refers to any
//! more, then giving the space back (VACUUM).
//!
//! Tenant-safe by construction: a conversation belongs to one tenant and
//! goes with everything that is its own; items are content-addressed and
//! shared, so an item goes only once no exchange of any tenant refers to
//! it. An exchange of another conversation whose request was stored as a
//! reference to a deleted exchange's items gets those items written out
//! first, so it reads back the same.

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::query::{archive_refs, parse_hex8};
use super::sqlite::{pack_hashes, request_item_hashes, unpack_hashes};
use super::StoreError;
use crate::wire::ItemHash;

/// Items deleted per transaction: a running proxy's writer waits for the
/// lock no longer than one batch takes.
const ITEM_BATCH: usize = 2000;

/// What a deletion removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removed {
    /// Conversations.
    pub conversations: u64,
    /// Their exchanges.
    pub exchanges: u64,
    /// Their compactions.
    pub compactions: u64,
    /// Items no record referred to any more.
    pub items: u64,
}

impl Removed {
    fn add(&mut self, other: Removed) {
        self.conversations += other.conversations;
        self.exchanges += other.exchanges;
        self.compactions += other.compactions;
        self.items += other.items;
    }
}

/// A writable connection to the store at `path` for maintenance, beside a
/// proxy that may be writing (it waits for the lock as the proxy does).
pub fn open_for_maintenance(path: &std::path::Path) -> Result<Connection, StoreError> {
    if !path.exists() {
        return Err(StoreError::Io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no store at {}", path.display()),
        )));
    }
    let conn = Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(30))?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    Ok(conn)
}

/// The tenant of conversation `id`, if it exists.
pub fn tenant_of(conn: &Connection, id: &str) -> Result<Option<String>, StoreError> {
    Ok(conn
        .query_row(
            "SELECT tenant FROM conversations WHERE id = ?1",
            params![id],
            |r| r.get(0),
        )
        .optional()?)
}

/// The ids of conversation `id`'s compactions.
pub fn compactions_of(conn: &Connection, id: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare("SELECT id FROM compactions WHERE conversation_id = ?1")?;
    let rows = stmt
        .query_map(params![id], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

/// Deletes conversation `id` with its exchanges and compactions, in one
/// transaction. Items stay (see [`prune_items`]).
pub fn delete_conversation(conn: &mut Connection, id: &str) -> Result<Removed, StoreError> {
    let tx = conn.transaction()?;
    // Exchanges elsewhere stored as a reference into this conversation:
    // their requests written out in full first.
    let dependents: Vec<i64> = tx
        .prepare(
            "SELECT id FROM exchanges WHERE conversation_id <> ?1
               AND prefix_exchange IN (SELECT id FROM exchanges WHERE conversation_id = ?1)",
        )?
        .query_map(params![id], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for dependent in dependents {
        let items = request_item_hashes(&tx, dependent)?;
        tx.execute(
            "UPDATE exchanges SET prefix_exchange = NULL, prefix_len = 0, prefix_full = 0,
                                  suffix_items = ?2 WHERE id = ?1",
            params![dependent, pack_hashes(&items)],
        )?;
    }
    let exchanges = tx.execute(
        "DELETE FROM exchanges WHERE conversation_id = ?1",
        params![id],
    )?;
    let compactions = tx.execute(
        "DELETE FROM compactions WHERE conversation_id = ?1",
        params![id],
    )?;
    let conversations = tx.execute("DELETE FROM conversations WHERE id = ?1", params![id])?;
    tx.commit()?;
    Ok(Removed {
        conversations: conversations as u64,
        exchanges: exchanges as u64,
        compactions: compactions as u64,
        items: 0,
    })
}

/// Conversations last seen before `cutoff_ms` (Unix ms), at most `limit`,
/// oldest first.
pub fn seen_before(
    conn: &Connection,
    cutoff_ms: i64,
    limit: usize,
) -> Result<Vec<(String, String)>, StoreError> {
    let mut stmt = conn.prepare(
        "SELECT tenant, id FROM conversations WHERE last_seen_ms < ?1
         ORDER BY last_seen_ms LIMIT ?2",
    )?;
    let rows = stmt
        .query_map(params![cutoff_ms, limit as i64], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

/// Deletes the items no exchange refers to (by its request, its answer or
/// its parameters) and no remaining compaction names as an archived
/// original; returns how many went.
pub fn prune_items(conn: &mut Connection) -> Result<u64, StoreError> {
    let mut referenced: foldhash::HashSet<ItemHash> = Default::default();
    {
        let mut stmt =
            conn.prepare("SELECT suffix_items, response_items, params FROM exchanges")?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            for column in 0..3 {
                let blob: Vec<u8> = r.get(column)?;
                referenced.extend(unpack_hashes(&blob));
            }
        }
    }
    // Archived originals are named by the first 8 bytes of their hash.
    let mut archived: foldhash::HashSet<[u8; 8]> = Default::default();
    {
        let mut stmt = conn.prepare("SELECT replacement FROM compactions")?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            let text: String = r.get(0)?;
            for reference in archive_refs(&text) {
                if let Some(prefix) = parse_hex8(&reference["item:".len()..]) {
                    archived.insert(prefix);
                }
            }
        }
    }
    let mut unreferenced: Vec<i64> = Vec::new();
    {
        let mut stmt = conn.prepare("SELECT rowid, hash FROM items")?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            let hash: Vec<u8> = r.get(1)?;
            let Some(h) = unpack_hashes(&hash).into_iter().next() else {
                continue;
            };
            let mut prefix = [0u8; 8];
            prefix.copy_from_slice(&h[..8]);
            if !referenced.contains(&h) && !archived.contains(&prefix) {
                unreferenced.push(r.get(0)?);
            }
        }
    }
    for batch in unreferenced.chunks(ITEM_BATCH) {
        let tx = conn.transaction()?;
        {
            let mut delete = tx.prepare_cached("DELETE FROM items WHERE rowid = ?1")?;
            for rowid in batch {
                delete.execute(params![rowid])?;
            }
        }
        tx.commit()?;
    }
    Ok(unreferenced.len() as u64)
}

/// Gives the space of what was deleted back to the file system.
pub fn vacuum(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("VACUUM")?;
    Ok(())
}

/// Deletes `conversations` (each with what is its own), then the items no
/// longer referred to, then vacuums when anything went.
pub fn delete_and_prune(
    conn: &mut Connection,
    conversations: &[String],
) -> Result<Removed, StoreError> {
    let mut removed = Removed::default();
    for id in conversations {
        removed.add(delete_conversation(conn, id)?);
    }
    removed.items = prune_items(conn)?;
    if removed != Removed::default() {
        vacuum(conn)?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteBackend;
    use crate::store::{Backend, PrefixRef, Record};

    #[test]
    fn an_exchange_stored_as_a_reference_into_a_deleted_one_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let mut b = SqliteBackend::open(&path).unwrap();
        let first = crate::store::journal::tests::record(1);
        let mut second = crate::store::journal::tests::record(2);
        second.conversation = "conv_b".into();
        second.prefix = Some(PrefixRef {
            exchange: 1,
            len: 1,
            full: false,
        });
        b.write(&[
            Record::Exchange(Box::new(first)),
            Record::Exchange(Box::new(second)),
        ])
        .unwrap();
        let before = request_item_hashes(b.connection(), 2).unwrap();
        assert_eq!(before.len(), 3, "one through the reference, two its own");
        drop(b);
        let mut conn = open_for_maintenance(&path).unwrap();
        let removed = delete_and_prune(&mut conn, &["conv_1".to_string()]).unwrap();
        assert_eq!((removed.conversations, removed.exchanges), (1, 1));
        assert_eq!(request_item_hashes(&conn, 2).unwrap(), before);
        // The shared item stays: the other exchange refers to it.
        let body: Option<String> = conn
            .query_row(
                "SELECT body FROM items WHERE hash = ?1",
                [before[0].to_vec()],
                |r| r.get(0),
            )
            .optional()
            .unwrap();
        assert!(body.is_some());
    }
}
