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
//!
//! On a store replicas share, a replica refers to an item it believes
//! stored by its hash alone: the scan for unreferenced items waits until
//! every replica has heard of the last deletion and what it was committing
//! then has ended (`prune_items_alone`), and deletes them under a lock
//! that keeps what was committed since (`delete_items_shared`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::StoreError;
use super::query::{archive_refs, parse_hex8};
use super::rows::{pack_hashes, request_item_hashes, unpack_hashes};
use super::sql::{Param, Sql};
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

/// A conversation to delete, and what deleting it needs.
#[derive(Debug, Clone)]
pub struct Victim {
    /// Its tenant.
    pub tenant: String,
    /// Its id.
    pub id: String,
    /// Its compactions' ids (forgotten in memory first).
    pub compactions: Vec<String>,
}

/// [`Victim`]s of `(tenant, id)` pairs read on `conn`.
pub fn victims_of(conn: &dyn Sql, found: Vec<(String, String)>) -> Result<Vec<Victim>, StoreError> {
    found
        .into_iter()
        .map(|(tenant, id)| {
            let compactions = compactions_of(conn, &id)?;
            Ok(Victim {
                tenant,
                id,
                compactions,
            })
        })
        .collect()
}

/// The tenant of conversation `id`, if it exists.
pub fn tenant_of(conn: &dyn Sql, id: &str) -> Result<Option<String>, StoreError> {
    conn.first(
        "SELECT tenant FROM conversations WHERE id = ?1",
        &[id.into()],
    )?
    .map(|r| r.get(0))
    .transpose()
}

/// The conversation `name` names (see [`super::query::resolve_id`]), with
/// what deleting it needs.
pub fn victim(conn: &dyn Sql, name: &str) -> Result<Victim, super::query::QueryError> {
    use super::query::QueryError;
    let id = super::query::resolve_id(conn, name)?;
    let tenant = tenant_of(conn, &id)?.ok_or(QueryError::NotFound(id.clone()))?;
    let mut found = victims_of(conn, vec![(tenant, id.clone())])?;
    found.pop().ok_or(QueryError::NotFound(id))
}

/// Runs `f` in one transaction on `conn`: committed if it succeeds, rolled
/// back if not.
fn in_transaction<T>(
    conn: &dyn Sql,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    conn.execute("BEGIN", &[])?;
    match f() {
        Ok(v) => {
            conn.execute("COMMIT", &[])?;
            Ok(v)
        }
        Err(e) => {
            let _ = conn.execute("ROLLBACK", &[]);
            Err(e)
        }
    }
}

/// The ids of conversation `id`'s compactions.
pub fn compactions_of(conn: &dyn Sql, id: &str) -> Result<Vec<String>, StoreError> {
    conn.rows(
        "SELECT id FROM compactions WHERE conversation_id = ?1",
        &[id.into()],
    )?
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Deletes conversation `id` with its exchanges and compactions, in one
/// transaction. Items stay (see [`prune_items`]).
pub fn delete_conversation(conn: &dyn Sql, id: &str) -> Result<Removed, StoreError> {
    in_transaction(conn, || {
        // Exchanges elsewhere stored as a reference into this conversation:
        // their requests written out in full first.
        let dependents = conn.rows(
            "SELECT id FROM exchanges WHERE conversation_id <> ?1
               AND prefix_exchange IN (SELECT id FROM exchanges WHERE conversation_id = ?1)",
            &[id.into()],
        )?;
        for dependent in &dependents {
            let dependent: i64 = dependent.get(0)?;
            let items = request_item_hashes(conn, dependent)?;
            conn.execute(
                "UPDATE exchanges SET prefix_exchange = NULL, prefix_len = 0,
                                      prefix_full = ?3, suffix_items = ?2 WHERE id = ?1",
                // `false` as an integer: SQLite's flags are integers, and
                // PostgreSQL's statement binds it as the BOOLEAN its column is.
                &[dependent.into(), pack_hashes(&items).into(), Param::Int(0)],
            )?;
        }
        let mut removed = Removed::default();
        for (table, column, count) in [
            ("exchanges", "conversation_id", &mut removed.exchanges),
            ("compactions", "conversation_id", &mut removed.compactions),
            ("conversations", "id", &mut removed.conversations),
        ] {
            *count = conn.execute(
                &format!("DELETE FROM {table} WHERE {column} = ?1"),
                &[id.into()],
            )?;
        }
        // Last, so that the time is that of the commit, near enough: a
        // scan that began before it sees the deletion made while it read.
        if conn.dialect() == super::sql::Dialect::Postgres {
            mark_deletion(conn)?;
        }
        Ok(removed)
    })
}

/// Notes the time of a deletion (see [`DELETED_KEY`]): taken once the row
/// is this session's, should another deletion hold it.
fn mark_deletion(conn: &dyn Sql) -> Result<(), StoreError> {
    conn.execute(
        &format!(
            "INSERT INTO meta (key, value) VALUES (?1, convert_to({CLOCK_MS}::text, 'UTF8'))
             ON CONFLICT (key) DO UPDATE SET value = convert_to({CLOCK_MS}::text, 'UTF8')"
        ),
        &[DELETED_KEY.into()],
    )?;
    Ok(())
}

/// The `meta` key under which a shared store keeps when a conversation
/// was last deleted (Unix ms by the database's clock, as text): the
/// unreferenced-item scan starts [`settle`] after it at the earliest.
const DELETED_KEY: &str = "deleted_ms";

/// The database's clock, Unix ms: one clock for every process, whatever
/// their hosts' say.
const CLOCK_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// How long a deletion's announcement may take to reach a listening
/// replica and be applied there, at most, as the scan allows for it.
pub const FORGET_SLACK: Duration = Duration::from_secs(2);

/// How long after the last deletion the unreferenced-item scan of a shared
/// store waits: a replica's commit under way when it heard of the
/// deletion has ended by then (committed, so the scan sees what it refers
/// to, or timed out, so it is written again with every item's body), and
/// every record it commits after hearing carries the bodies it left out.
pub fn settle(conn: &dyn Sql) -> Duration {
    conn.commit_timeout() + FORGET_SLACK
}

/// How many times the scan starts again after a deletion committed while
/// it read, before it is left to the scan after the next deletion.
const SETTLE_TRIES: usize = 3;

/// When the last deletion committed (see [`DELETED_KEY`]), once
/// [`settle`] has passed since: waits until then.
fn settled(conn: &dyn Sql) -> Result<i64, StoreError> {
    let settle = settle(conn).as_millis().min(i64::MAX as u128) as i64;
    loop {
        let (last, now) = latest_deletion(conn)?;
        let due = last.saturating_add(settle).saturating_sub(now);
        if due <= 0 {
            return Ok(last);
        }
        tracing::info!(
            wait_ms = due,
            "the item scan waits for replicas to hear of a deletion"
        );
        std::thread::sleep(Duration::from_millis(due as u64));
    }
}

/// When the last deletion committed (0: none yet) and the time now, both
/// by the database's clock.
fn latest_deletion(conn: &dyn Sql) -> Result<(i64, i64), StoreError> {
    let row = conn.first(
        &format!(
            "SELECT COALESCE((SELECT convert_from(value, 'UTF8')::bigint FROM meta
                              WHERE key = ?1), 0), {CLOCK_MS}"
        ),
        &[DELETED_KEY.into()],
    )?;
    match row {
        Some(r) => Ok((r.get(0)?, r.get(1)?)),
        None => Ok((0, 0)),
    }
}

/// Conversations last seen before `cutoff_ms` (Unix ms), at most `limit`,
/// oldest first.
pub fn seen_before(
    conn: &dyn Sql,
    cutoff_ms: i64,
    limit: usize,
) -> Result<Vec<(String, String)>, StoreError> {
    let limit = limit.min(i64::MAX as usize) as i64;
    conn.rows(
        "SELECT tenant, id FROM conversations WHERE last_seen_ms < ?1
         ORDER BY last_seen_ms LIMIT ?2",
        &[cutoff_ms.into(), limit.into()],
    )?
    .iter()
    .map(|r| Ok((r.get(0)?, r.get(1)?)))
    .collect()
}

/// Deletes the items no exchange refers to (by its request, its answer or
/// its parameters) and no remaining compaction names as an archived
/// original; returns how many went.
pub fn prune_items(conn: &dyn Sql) -> Result<u64, StoreError> {
    delete_items(conn, &unreferenced(conn, None)?)
}

/// The items no exchange refers to and no compaction names, as of the
/// scan; the exchanges it read go into `scanned` when given.
fn unreferenced(
    conn: &dyn Sql,
    mut scanned: Option<&mut foldhash::HashSet<i64>>,
) -> Result<Vec<ItemHash>, StoreError> {
    let mut referenced: foldhash::HashSet<ItemHash> = Default::default();
    for r in conn.rows(
        "SELECT suffix_items, response_items, params, id FROM exchanges",
        &[],
    )? {
        for column in 0..3 {
            referenced.extend(unpack_hashes(&r.get::<Vec<u8>>(column)?));
        }
        if let Some(ids) = scanned.as_deref_mut() {
            ids.insert(r.get(3)?);
        }
    }
    // Archived originals are named by the first 8 bytes of their hash.
    let mut archived: foldhash::HashSet<[u8; 8]> = Default::default();
    for r in conn.rows("SELECT replacement FROM compactions", &[])? {
        for reference in archive_refs(&r.get::<String>(0)?) {
            if let Some(prefix) = parse_hex8(&reference["item:".len()..]) {
                archived.insert(prefix);
            }
        }
    }
    let mut unreferenced: Vec<ItemHash> = Vec::new();
    for r in conn.rows("SELECT hash FROM items", &[])? {
        let Some(h) = unpack_hashes(&r.get::<Vec<u8>>(0)?).into_iter().next() else {
            continue;
        };
        let mut prefix = [0u8; 8];
        prefix.copy_from_slice(&h[..8]);
        if !referenced.contains(&h) && !archived.contains(&prefix) {
            unreferenced.push(h);
        }
    }
    Ok(unreferenced)
}

/// Deletes `unreferenced`, [`ITEM_BATCH`] a transaction.
fn delete_items(conn: &dyn Sql, unreferenced: &[ItemHash]) -> Result<u64, StoreError> {
    for batch in unreferenced.chunks(ITEM_BATCH) {
        in_transaction(conn, || {
            for hash in batch {
                conn.execute(
                    "DELETE FROM items WHERE hash = ?1",
                    &[hash.as_slice().into()],
                )?;
            }
            Ok(())
        })?;
    }
    Ok(unreferenced.len() as u64)
}

/// [`delete_items`] on a store replicas share, whose writers go on while
/// it runs: each batch is deleted under a lock every insert of items
/// waits for (and that waits for the inserts under way), after reading
/// the exchanges committed since the scan (those not in `scanned`). An
/// item one of them refers to stays: a writer that found it stored and
/// left it as it was, or that wrote it while the scan read, committed
/// before the lock was granted; one that comes after the lock writes it
/// anew. Returns how many went.
fn delete_items_shared(
    conn: &dyn Sql,
    unreferenced: &[ItemHash],
    mut scanned: foldhash::HashSet<i64>,
) -> Result<u64, StoreError> {
    let mut since: foldhash::HashSet<ItemHash> = Default::default();
    let mut deleted = 0;
    for batch in unreferenced.chunks(ITEM_BATCH) {
        // Most of what was committed since is read before the lock, so
        // that what is left to read under it is what came in between.
        catch_up(conn, &mut scanned, &mut since)?;
        deleted += in_transaction(conn, || {
            conn.execute("LOCK TABLE items IN SHARE ROW EXCLUSIVE MODE", &[])?;
            catch_up(conn, &mut scanned, &mut since)?;
            let doomed: Vec<u8> = batch
                .iter()
                .filter(|h| !since.contains(*h))
                .flatten()
                .copied()
                .collect();
            if doomed.is_empty() {
                return Ok(0);
            }
            // One statement for the batch: the lock is held no longer than
            // that takes.
            conn.execute(
                "DELETE FROM items WHERE hash IN (
                     SELECT substring(?1::bytea FROM i * 32 + 1 FOR 32)
                     FROM generate_series(0, length(?1::bytea) / 32 - 1) i)",
                &[doomed.as_slice().into()],
            )
        })?;
    }
    Ok(deleted)
}

/// Adds what the exchanges not in `scanned` refer to to `referenced`, and
/// them to `scanned`.
fn catch_up(
    conn: &dyn Sql,
    scanned: &mut foldhash::HashSet<i64>,
    referenced: &mut foldhash::HashSet<ItemHash>,
) -> Result<(), StoreError> {
    let mut new: Vec<i64> = Vec::new();
    for r in conn.rows("SELECT id FROM exchanges", &[])? {
        let id: i64 = r.get(0)?;
        if !scanned.contains(&id) {
            new.push(id);
        }
    }
    for id in new {
        let row = conn.first(
            "SELECT suffix_items, response_items, params FROM exchanges WHERE id = ?1",
            &[id.into()],
        )?;
        if let Some(row) = row {
            for column in 0..3 {
                referenced.extend(unpack_hashes(&row.get::<Vec<u8>>(column)?));
            }
        }
        scanned.insert(id);
    }
    Ok(())
}

/// The key of the advisory lock the unreferenced-item scan of a shared
/// store runs under.
pub const PRUNE_LOCK: i64 = 0x636f_6d70_6163_7402;

/// [`prune_items`] on a store replicas share, by one of them at a time: the
/// scan reads every exchange, and replicas applying `retain_days` on the
/// same hour would each make it. While another holds the lock this one
/// skips it (0 items): the scan under way, or the next one, takes what this
/// deletion left unreferenced.
///
/// The scan starts [`settle`] after the last deletion, by whichever
/// process: until every replica has heard of it, a replica may commit a
/// record that refers to an item of it by its hash alone, believing it
/// stored. A deletion committed while the scan ran makes it start again
/// (after its own wait).
fn prune_items_alone(conn: &dyn Sql) -> Result<u64, StoreError> {
    let taken = conn
        .first("SELECT pg_try_advisory_lock(?1)", &[PRUNE_LOCK.into()])?
        .map(|r| r.get::<i64>(0))
        .transpose()?
        == Some(1);
    if !taken {
        tracing::info!("another process scans for unreferenced items now: skipped here");
        return Ok(0);
    }
    let mut scanned = Default::default();
    let pruned = settled_scan(conn, &mut scanned)
        .and_then(|found| delete_items_shared(conn, &found, scanned));
    // A session's lock: released whatever happened (a connection that
    // failed is closed, which releases it too).
    let unlocked = conn.execute("SELECT pg_advisory_unlock(?1)", &[PRUNE_LOCK.into()]);
    let pruned = pruned?;
    unlocked?;
    Ok(pruned)
}

/// [`unreferenced`], scanned [`settle`] after the last deletion, and with
/// no deletion committed while it ran (none if deletions kept coming).
fn settled_scan(
    conn: &dyn Sql,
    scanned: &mut foldhash::HashSet<i64>,
) -> Result<Vec<ItemHash>, StoreError> {
    for _ in 0..SETTLE_TRIES {
        let last = settled(conn)?;
        scanned.clear();
        let found = unreferenced(conn, Some(scanned))?;
        if latest_deletion(conn)?.0 == last {
            return Ok(found);
        }
    }
    tracing::info!("deletions went on during the item scan: it is left to the next one");
    Ok(Vec::new())
}

/// The PostgreSQL channel on which replicas hear which conversations were
/// deleted: each forgets them, their compactions, and which items it
/// believed stored. A payload is lines of `tenant conversation
/// [compaction…]`, space-separated (no id holds a space); see
/// [`forgotten`].
pub const FORGET_CHANNEL: &str = "compactor_forget";

/// Bytes one notification carries at most (PostgreSQL's payload limit is
/// 8,000).
const FORGET_PAYLOAD: usize = 7_000;

/// The payloads that tell the replicas listening on [`FORGET_CHANNEL`]
/// that `victims` are gone: a conversation with more compactions than one
/// payload holds goes on in the next, on a line of its own.
fn forget_payloads(victims: &[Victim]) -> Vec<String> {
    let mut payloads = vec![String::new()];
    for v in victims {
        let head = format!("{} {}", v.tenant, v.id);
        let mut line = head.clone();
        for c in &v.compactions {
            if line.len() + 1 + c.len() > FORGET_PAYLOAD / 2 {
                push_line(&mut payloads, std::mem::replace(&mut line, head.clone()));
            }
            line.push(' ');
            line.push_str(c);
        }
        push_line(&mut payloads, line);
    }
    payloads.retain(|p| !p.is_empty());
    payloads
}

fn push_line(payloads: &mut Vec<String>, line: String) {
    let last = payloads
        .last_mut()
        .filter(|p| p.len() + 1 + line.len() <= FORGET_PAYLOAD);
    match last {
        Some(p) => {
            if !p.is_empty() {
                p.push('\n');
            }
            p.push_str(&line);
        }
        None => payloads.push(line),
    }
}

/// What a [`FORGET_CHANNEL`] payload says is gone: (tenant, conversation,
/// its compactions).
pub fn forgotten(payload: &str) -> Vec<(String, String, Vec<String>)> {
    payload
        .lines()
        .filter_map(|line| {
            let mut words = line.split(' ').filter(|w| !w.is_empty());
            let tenant = words.next()?.to_string();
            let conversation = words.next()?.to_string();
            Some((tenant, conversation, words.map(String::from).collect()))
        })
        .collect()
}

/// Gives the space of what was deleted back to the file system.
pub fn vacuum(conn: &dyn Sql) -> Result<(), StoreError> {
    // PostgreSQL's autovacuum reuses the space; a VACUUM there would wait
    // for every replica's open transaction.
    if conn.dialect() == super::sql::Dialect::Sqlite {
        conn.execute("VACUUM", &[])?;
    }
    Ok(())
}

/// Deletes `conversations` (each with what is its own), then the items no
/// longer referred to, then vacuums when anything went.
pub fn delete_and_prune(conn: &dyn Sql, conversations: &[String]) -> Result<Removed, StoreError> {
    // Replicas sharing a PostgreSQL store are told what went, before the
    // items go: each forgets which items it believed stored.
    let shared = conn.dialect() == super::sql::Dialect::Postgres;
    let mut victims = Vec::new();
    if shared {
        for id in conversations {
            if let Some(tenant) = tenant_of(conn, id)? {
                victims.extend(victims_of(conn, vec![(tenant, id.clone())])?);
            }
        }
    }
    let mut removed = Removed::default();
    for id in conversations {
        removed.add(delete_conversation(conn, id)?);
    }
    for payload in forget_payloads(&victims) {
        conn.execute(
            "SELECT pg_notify(?1, ?2)",
            &[FORGET_CHANNEL.into(), payload.as_str().into()],
        )?;
    }
    // The wait before the scan counts from the announcement (the last of
    // many deletions may come well after the first).
    if shared && !victims.is_empty() {
        mark_deletion(conn)?;
    }
    removed.items = if shared {
        prune_items_alone(conn)?
    } else {
        prune_items(conn)?
    };
    if removed != Removed::default() {
        vacuum(conn)?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::{open_for_maintenance, SqliteBackend};
    use crate::store::{Backend, PrefixRef, Record};

    #[test]
    fn forget_payloads_stay_under_the_limit_and_read_back_whole() {
        let many: Vec<String> = (0..400).map(|i| format!("cmp_{i:024}")).collect();
        let victims = vec![
            Victim {
                tenant: "t".repeat(64),
                id: "conv_a".into(),
                compactions: many.clone(),
            },
            Victim {
                tenant: "u".repeat(64),
                id: "conv_b".into(),
                compactions: vec![],
            },
        ];
        let payloads = forget_payloads(&victims);
        assert!(payloads.len() > 1, "400 compactions need several payloads");
        assert!(payloads.iter().all(|p| p.len() <= FORGET_PAYLOAD));
        let mut read: Vec<(String, String, Vec<String>)> =
            payloads.iter().flat_map(|p| forgotten(p)).collect();
        assert!(read
            .iter()
            .all(|(t, c, _)| (t, c.as_str()) == (&"t".repeat(64), "conv_a")
                || (t, c.as_str()) == (&"u".repeat(64), "conv_b")));
        let named: Vec<String> = read.iter_mut().flat_map(|r| r.2.drain(..)).collect();
        assert_eq!(named, many, "every compaction named once, in order");
        assert!(read.iter().any(|(_, c, _)| c == "conv_b"));
    }

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
        let conn = open_for_maintenance(&path).unwrap();
        let removed = delete_and_prune(&conn, &["conv_1".to_string()]).unwrap();
        assert_eq!((removed.conversations, removed.exchanges), (1, 1));
        assert_eq!(request_item_hashes(&conn, 2).unwrap(), before);
        // The shared item stays: the other exchange refers to it.
        let body = crate::store::rows::item_body(&conn, &before[0]).unwrap();
        assert!(body.is_some());
    }
}
