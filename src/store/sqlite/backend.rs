//! SQLite's writer connection and its point reads.
//!
//! Durability: WAL with `synchronous = NORMAL` makes every committed
//! transaction survive the process being killed (the data is in the OS once
//! `COMMIT` returns); only a power loss may cost the last transactions.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use crate::compaction::Compaction;
use crate::store::batch::{conversation_merge, conversation_spans};
use crate::store::error::StoreError;
use crate::store::records::{
    ExchangeRecord, IndexedExchange, Limits, Record, Snapshot, StoredCompaction, KNOWN_ITEMS,
};
use crate::store::rows::{
    load_compaction, load_windows, pack_hashes, response_history, unpack_hashes,
};
use crate::store::traits::{Backend, Reads};
use crate::windows::Told;
use crate::wire::ItemHash;

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
-- Each distinct item (message, tool output, request parameters…) once.
-- A rowid table: bodies of kilobytes appended in arrival order, with the
-- hash in an index, insert about twice as fast as a WITHOUT ROWID table
-- ordered by random hashes.
CREATE TABLE IF NOT EXISTS items (
    hash BLOB PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS conversations (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    explicit_key TEXT,
    created_ms   INTEGER NOT NULL,
    last_seen_ms INTEGER NOT NULL,
    model        TEXT NOT NULL DEFAULT '',
    -- Its first user message (redacted, bounded), the client of its latest
    -- exchange, and the latest ids the client sent for it: what people
    -- know a conversation by.
    preview      TEXT,
    client       TEXT,
    conversation_header TEXT,
    session_id   TEXT,
    prompt_cache_key TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS conversations_key
    ON conversations (tenant, explicit_key) WHERE explicit_key IS NOT NULL;
-- Request items are stored as a reference to an earlier exchange's items
-- (prefix_exchange, prefix_len, prefix_full) plus the hashes that follow
-- (suffix_items: concatenated 32-byte hashes).
CREATE TABLE IF NOT EXISTS exchanges (
    id              INTEGER PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id),
    tenant          TEXT NOT NULL,
    endpoint        TEXT NOT NULL,
    model           TEXT NOT NULL,
    prefix_exchange INTEGER,
    prefix_len      INTEGER NOT NULL DEFAULT 0,
    prefix_full     INTEGER NOT NULL DEFAULT 0,
    suffix_items    BLOB NOT NULL,
    request_len     INTEGER NOT NULL,
    params          BLOB NOT NULL,
    response_items  BLOB NOT NULL,
    response_id     TEXT,
    input_tokens    INTEGER,
    output_tokens   INTEGER,
    cached_tokens   INTEGER,
    status          INTEGER NOT NULL,
    streamed        INTEGER NOT NULL,
    partial         INTEGER NOT NULL,
    error           TEXT,
    started_ms      INTEGER NOT NULL,
    latency_ms      REAL NOT NULL,
    ttfb_ms         REAL,
    chain_request   BLOB,
    chain_full      BLOB,
    compaction_id   TEXT,
    -- The window the request was measured against, and its source
    -- (table, config, learned, discovered).
    context_window  INTEGER,
    window_source   TEXT,
    client          TEXT,
    conversation_header TEXT,
    session_id      TEXT,
    prompt_cache_key TEXT,
    mode            TEXT NOT NULL DEFAULT 'auto',
    tokens_saved    INTEGER NOT NULL DEFAULT 0,
    tokens_saved_potential INTEGER NOT NULL DEFAULT 0,
    observed_compaction TEXT,
    recall_rounds   INTEGER NOT NULL DEFAULT 0,
    recall_input_tokens INTEGER NOT NULL DEFAULT 0,
    recall_output_tokens INTEGER NOT NULL DEFAULT 0,
    -- Prompt tokens the upstream reported written to its cache, and of
    -- those the ones written for an hour (NULL: not reported).
    cache_write_tokens INTEGER,
    cache_write_1h_tokens INTEGER
);
-- A conversation's timeline, as the views read it (by time: a shared
-- store's ids interleave across replicas, and the views are written once);
-- every query of a conversation's exchanges uses it. (An index by
-- (conversation_id, id) that only cost every insert is dropped.)
DROP INDEX IF EXISTS exchanges_conversation;
CREATE INDEX IF NOT EXISTS exchanges_timeline ON exchanges (conversation_id, started_ms, id);
-- A compaction replaces the first covered_len items whose chain hash is
-- covered_chain with `replacement` (a JSON array, sent byte-identically).
CREATE TABLE IF NOT EXISTS compactions (
    id              TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    covered_len     INTEGER NOT NULL,
    covered_chain   BLOB NOT NULL,
    replacement     TEXT NOT NULL,
    rung            TEXT NOT NULL,
    reason          TEXT NOT NULL,
    tokens_before   INTEGER NOT NULL,
    tokens_after    INTEGER NOT NULL,
    items_removed   INTEGER NOT NULL,
    items_kept      INTEGER NOT NULL,
    summary         TEXT,
    facts           TEXT,
    base_id         TEXT,
    summary_calls   INTEGER NOT NULL,
    duration_ms     INTEGER NOT NULL,
    created_ms      INTEGER NOT NULL,
    summary_tokens  INTEGER NOT NULL DEFAULT 0,
    summary_output_tokens INTEGER NOT NULL DEFAULT 0,
    tokens_saved    INTEGER NOT NULL DEFAULT 0,
    observed        INTEGER NOT NULL DEFAULT 0,
    -- Its facts checklist and the items it removed, as JSON (NULL for one
    -- stored before audits were kept).
    audit           TEXT,
    -- What its summary calls' prompts read from and wrote to the
    -- upstream's cache, as reported (0: not reported, or no call).
    summary_cached_tokens         INTEGER NOT NULL DEFAULT 0,
    summary_cache_write_tokens    INTEGER NOT NULL DEFAULT 0,
    summary_cache_write_1h_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS compactions_conversation ON compactions (conversation_id, created_ms);
-- The context windows upstreams told (stated in an overflow answer, or
-- reported when asked), per upstream and model.
CREATE TABLE IF NOT EXISTS windows (
    upstream   TEXT NOT NULL,
    model      TEXT NOT NULL,
    window     INTEGER NOT NULL,
    source     TEXT NOT NULL,
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (upstream, model)
);
"#;

/// Columns added since a table was first created: (table, column, its
/// definition). A database created before gets them added at open.
const ADDED_COLUMNS: &[(&str, &str, &str)] = &[
    (
        "compactions",
        "summary_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    ("conversations", "preview", "TEXT"),
    ("conversations", "client", "TEXT"),
    ("conversations", "conversation_header", "TEXT"),
    ("conversations", "session_id", "TEXT"),
    ("conversations", "prompt_cache_key", "TEXT"),
    ("exchanges", "context_window", "INTEGER"),
    ("exchanges", "window_source", "TEXT"),
    ("exchanges", "client", "TEXT"),
    ("exchanges", "conversation_header", "TEXT"),
    ("exchanges", "session_id", "TEXT"),
    ("exchanges", "prompt_cache_key", "TEXT"),
    (
        "compactions",
        "summary_output_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    ("compactions", "tokens_saved", "INTEGER NOT NULL DEFAULT 0"),
    ("compactions", "observed", "INTEGER NOT NULL DEFAULT 0"),
    ("exchanges", "mode", "TEXT NOT NULL DEFAULT 'auto'"),
    ("exchanges", "tokens_saved", "INTEGER NOT NULL DEFAULT 0"),
    (
        "exchanges",
        "tokens_saved_potential",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    ("exchanges", "observed_compaction", "TEXT"),
    ("exchanges", "recall_rounds", "INTEGER NOT NULL DEFAULT 0"),
    (
        "exchanges",
        "recall_input_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    (
        "exchanges",
        "recall_output_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    ("compactions", "audit", "TEXT"),
    ("exchanges", "cache_write_tokens", "INTEGER"),
    ("exchanges", "cache_write_1h_tokens", "INTEGER"),
    (
        "compactions",
        "summary_cached_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    (
        "compactions",
        "summary_cache_write_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
    (
        "compactions",
        "summary_cache_write_1h_tokens",
        "INTEGER NOT NULL DEFAULT 0",
    ),
];

/// Adds the [`ADDED_COLUMNS`] an existing database lacks.
fn migrate(conn: &Connection) -> Result<(), StoreError> {
    for (table, column, definition) in ADDED_COLUMNS {
        let mut stmt = conn.prepare(&format!("PRAGMA table_info({table})"))?;
        let has = stmt
            .query_map([], |r| r.get::<_, String>(1))?
            .filter_map(Result::ok)
            .any(|c| c == *column);
        if !has {
            conn.execute_batch(&format!(
                "ALTER TABLE {table} ADD COLUMN {column} {definition}"
            ))?;
        }
    }
    Ok(())
}

/// SQLite backend over one database file.
pub struct SqliteBackend {
    conn: Connection,
    /// Dropping it stops the checkpointer thread.
    _checkpointer: Option<std::sync::mpsc::Sender<()>>,
}

/// The writer connection's page cache, KiB: holds the index pages of a
/// store of some hundred thousand exchanges.
const WRITER_CACHE_KIB: i64 = 32 * 1024;

/// How often the checkpointer copies the WAL into the database.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

impl SqliteBackend {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        migrate(&conn)?;
        Ok(Self {
            conn,
            _checkpointer: None,
        })
    }

    /// Opens the database for the writer: checkpoints (copying the WAL into
    /// the database, with an fsync) move to a thread of their own, so a
    /// commit an answer waits for never waits for one; commits ran up to
    /// ~130 ms behind an automatic checkpoint.
    pub fn open_writer(path: &Path) -> Result<Self, StoreError> {
        let mut me = Self::open(path)?;
        me.conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        // The writer's inserts land at random places in the hash and id
        // indexes; with SQLite's default 2 MB page cache a batch re-read
        // those pages from the file and spilled dirty ones to the WAL
        // before its commit. Statement journals (for the upserts) stay in
        // memory instead of a temp file.
        me.conn
            .pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
        me.conn.pragma_update(None, "temp_store", "MEMORY")?;
        let checkpoints = Connection::open(path)?;
        checkpoints.busy_timeout(std::time::Duration::from_secs(5))?;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("compactor-checkpoint".into())
            .spawn(move || loop {
                let last = matches!(
                    stopped.recv_timeout(CHECKPOINT_EVERY),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
                );
                if let Err(e) =
                    checkpoints.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                {
                    tracing::warn!(error = %e, "store checkpoint failed");
                }
                if last {
                    break;
                }
            })?;
        me._checkpointer = Some(stop);
        Ok(me)
    }

    /// The underlying connection, for read-only queries (CLI, tests).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

fn opt_hash(blob: Option<Vec<u8>>) -> Option<ItemHash> {
    blob.and_then(|b| unpack_hashes(&b).into_iter().next())
}

impl Backend for SqliteBackend {
    fn load(&mut self, limits: Limits) -> Result<Snapshot, StoreError> {
        self.load_newest(KNOWN_ITEMS, limits.exchanges, limits.keys)
    }

    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        write_conversations(&tx, batch)?;
        for rec in batch {
            match rec {
                Record::Exchange(e) => write_exchange(&tx, e)?,
                Record::Compaction(c) => write_compaction(&tx, c)?,
                Record::Window(w) => write_window(&tx, w)?,
            }
        }
        tx.commit()?;
        Ok(())
    }
}

impl SqliteBackend {
    /// The snapshot with the newest `items` item hashes, `exchanges`
    /// exchanges and `keys` explicit keys only: the rest of the store must
    /// not decide how much memory a start-up takes.
    fn load_newest(
        &mut self,
        items: usize,
        exchanges: usize,
        keys: usize,
    ) -> Result<Snapshot, StoreError> {
        let mut snap = Snapshot::default();
        let salt: Option<Vec<u8>> = self
            .conn
            .query_row(
                "SELECT value FROM meta WHERE key = 'tenant_salt'",
                [],
                |r| r.get(0),
            )
            .optional()?;
        match salt {
            Some(s) if s.len() == 32 => snap.salt.copy_from_slice(&s),
            _ => {
                getrandom::fill(&mut snap.salt)
                    .map_err(|e| StoreError::Io(std::io::Error::other(e.to_string())))?;
                self.conn.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('tenant_salt', ?1)",
                    params![snap.salt.to_vec()],
                )?;
            }
        }
        let mut stmt = self
            .conn
            .prepare("SELECT hash FROM items ORDER BY rowid DESC LIMIT ?1")?;
        snap.item_hashes = stmt
            .query_map([items as i64], |r| r.get::<_, Vec<u8>>(0))?
            .filter_map(|r| r.ok().and_then(|b| opt_hash(Some(b))))
            .collect();
        let mut stmt = self.conn.prepare(
            "SELECT id, conversation_id, tenant, request_len, length(response_items) / 32,
                    chain_request, chain_full, response_id, prefix_exchange
             FROM exchanges ORDER BY id DESC LIMIT ?1",
        )?;
        snap.exchanges = stmt
            .query_map([exchanges as i64], |r| {
                Ok(IndexedExchange {
                    id: r.get(0)?,
                    conversation: r.get(1)?,
                    tenant: r.get(2)?,
                    request_len: r.get::<_, i64>(3)? as usize,
                    response_len: r.get::<_, i64>(4)? as usize,
                    chain_request: opt_hash(r.get(5)?),
                    chain_full: opt_hash(r.get(6)?),
                    chain_echoed: None,
                    response_id: r.get(7)?,
                    prefix_exchange: r.get(8)?,
                })
            })?
            .collect::<Result<_, _>>()?;
        snap.exchanges.reverse();
        snap.max_exchange_id = snap.exchanges.last().map(|e| e.id).unwrap_or(0);
        let mut stmt = self.conn.prepare(
            "SELECT tenant, explicit_key, id FROM conversations WHERE explicit_key IS NOT NULL
             ORDER BY last_seen_ms DESC, rowid DESC LIMIT ?1",
        )?;
        snap.keys = stmt
            .query_map([keys as i64 + 1], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<Result<_, _>>()?;
        snap.keys_truncated = snap.keys.len() > keys;
        snap.keys.truncate(keys);
        snap.keys.reverse();
        let mut stmt = self.conn.prepare(
            "SELECT id, tenant, conversation_id, covered_len, covered_chain, created_ms, observed
             FROM compactions ORDER BY created_ms, rowid",
        )?;
        snap.compactions = stmt
            .query_map([], |r| {
                Ok(StoredCompaction {
                    id: r.get(0)?,
                    tenant: r.get(1)?,
                    conversation: r.get(2)?,
                    covered_len: r.get::<_, i64>(3)? as usize,
                    covered_chain: opt_hash(r.get(4)?).unwrap_or([0; 32]),
                    created_ms: r.get(5)?,
                    observed: r.get(6)?,
                })
            })?
            .collect::<Result<_, _>>()?;
        snap.windows = load_windows(&self.conn)?;
        Ok(snap)
    }
}

/// The conversations of a batch's exchanges, each once (not once per
/// exchange; see `ConversationSpan`), before the exchanges, which refer to
/// them.
fn write_conversations(tx: &rusqlite::Transaction<'_>, batch: &[Record]) -> Result<(), StoreError> {
    // A key another conversation holds already (the index could not read it
    // from here, so named a new one) is not claimed again: the unique index
    // would fail the whole batch.
    static UPSERT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "INSERT INTO conversations (id, tenant, explicit_key, created_ms, last_seen_ms, model,
                                        preview, client, conversation_header, session_id,
                                        prompt_cache_key)
             VALUES (?1, ?2,
                     CASE WHEN EXISTS (SELECT 1 FROM conversations
                                       WHERE tenant = ?2 AND explicit_key = ?3 AND id <> ?1)
                          THEN NULL ELSE ?3 END,
                     ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
             {}",
            conversation_merge()
        )
    });
    let mut upsert = tx.prepare_cached(&UPSERT)?;
    for (conversation, span) in conversation_spans(batch) {
        upsert.execute(params![
            conversation,
            span.tenant,
            span.explicit_key,
            span.created_ms,
            span.last_seen_ms,
            span.model,
            span.preview,
            span.client,
            span.ids.header,
            span.ids.session,
            span.ids.cache_key,
        ])?;
    }
    Ok(())
}

fn write_exchange(tx: &rusqlite::Transaction<'_>, rec: &ExchangeRecord) -> Result<(), StoreError> {
    let mut item = tx.prepare_cached("INSERT OR IGNORE INTO items (hash, body) VALUES (?1, ?2)")?;
    for (hash, body) in &rec.new_items {
        item.execute(params![&hash[..], body])?;
    }
    tx.prepare_cached(
        "INSERT OR REPLACE INTO exchanges (id, conversation_id, tenant, endpoint, model,
            prefix_exchange, prefix_len, prefix_full, suffix_items, request_len, params,
            response_items, response_id, input_tokens, output_tokens, cached_tokens,
            status, streamed, partial, error, started_ms, latency_ms, ttfb_ms,
            chain_request, chain_full, compaction_id, context_window, window_source, client,
            conversation_header, session_id, prompt_cache_key, mode, tokens_saved,
            tokens_saved_potential, observed_compaction, recall_rounds, recall_input_tokens,
            recall_output_tokens, cache_write_tokens, cache_write_1h_tokens)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                 ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31,
                 ?32, ?33, ?34, ?35, ?36, ?37, ?38, ?39, ?40, ?41)",
    )?
    .execute(params![
        rec.id,
        rec.conversation,
        rec.tenant,
        rec.api.endpoint(),
        rec.model,
        rec.prefix.map(|p| p.exchange),
        rec.prefix.map(|p| p.len as i64).unwrap_or(0),
        rec.prefix.map(|p| p.full).unwrap_or(false),
        pack_hashes(&rec.suffix_items),
        rec.request_len as i64,
        &rec.params[..],
        pack_hashes(&rec.response_items),
        rec.response_id,
        rec.usage.map(|u| u.input_tokens as i64),
        rec.usage.map(|u| u.output_tokens as i64),
        rec.usage.and_then(|u| u.cached_tokens).map(|c| c as i64),
        rec.status,
        rec.streamed,
        rec.partial,
        rec.error,
        rec.started_ms,
        rec.latency_ms,
        rec.ttfb_ms,
        rec.chain_request.as_ref().map(|h| &h[..]),
        rec.chain_full.as_ref().map(|h| &h[..]),
        rec.compaction,
        rec.window.map(|w| w.tokens as i64),
        rec.window.map(|w| w.source.as_str()),
        rec.client,
        rec.client_ids.header,
        rec.client_ids.session,
        rec.client_ids.cache_key,
        rec.savings.mode.as_str(),
        rec.savings.tokens_saved as i64,
        rec.savings.tokens_saved_potential as i64,
        rec.savings.observed_compaction,
        rec.savings.recall_rounds,
        rec.savings.recall_input_tokens as i64,
        rec.savings.recall_output_tokens as i64,
        rec.usage
            .and_then(|u| u.cache_write_tokens)
            .map(|c| c as i64),
        rec.usage
            .and_then(|u| u.cache_write_1h_tokens)
            .map(|c| c as i64),
    ])?;
    Ok(())
}

fn write_compaction(tx: &rusqlite::Transaction<'_>, c: &Compaction) -> Result<(), StoreError> {
    let replacement = serde_json::to_string(&c.replacement).unwrap_or_else(|_| "[]".into());
    let facts = c.facts.as_ref().and_then(|f| serde_json::to_string(f).ok());
    let audit = c.audit.as_ref().and_then(|a| serde_json::to_string(a).ok());
    tx.prepare_cached(
        "INSERT OR REPLACE INTO compactions (id, tenant, conversation_id, covered_len, covered_chain,
            replacement, rung, reason, tokens_before, tokens_after, items_removed, items_kept,
            summary, facts, base_id, summary_calls, duration_ms, created_ms, summary_tokens,
            summary_output_tokens, tokens_saved, observed, audit, summary_cached_tokens,
            summary_cache_write_tokens, summary_cache_write_1h_tokens)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18,
            ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26)",
    )?
    .execute(params![
        c.id,
        c.tenant,
        c.conversation,
        c.covered_len as i64,
        c.covered_chain.to_vec(),
        replacement,
        c.rung.as_str(),
        c.reason,
        c.tokens_before as i64,
        c.tokens_after as i64,
        c.items_removed as i64,
        c.items_kept as i64,
        c.summary,
        facts,
        c.base,
        c.summary_calls,
        c.duration_ms as i64,
        c.created_ms,
        c.summary_tokens as i64,
        c.summary_output_tokens as i64,
        c.tokens_saved as i64,
        c.observed,
        audit,
        c.summary_cache.read as i64,
        c.summary_cache.write as i64,
        c.summary_cache.write_1h as i64,
    ])?;
    Ok(())
}

fn write_window(tx: &rusqlite::Transaction<'_>, w: &Told) -> Result<(), StoreError> {
    tx.prepare_cached(
        "INSERT OR REPLACE INTO windows (upstream, model, window, source, updated_ms)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![
        w.upstream,
        w.model,
        w.window as i64,
        w.source.as_str(),
        w.updated_ms
    ])?;
    Ok(())
}

/// A query that finds one thing, or nothing.
type Query<'a, T> = dyn Fn(&Connection) -> Result<Option<T>, StoreError> + 'a;

/// A query runner over a read-only connection of its own, opened when
/// first needed and again after an error; a failure is logged and reads
/// as nothing found.
fn read_only<T>(path: std::path::PathBuf) -> impl Fn(&Query<'_, T>) -> Option<T> + Send + Sync {
    let conn: std::sync::Mutex<Option<Connection>> = std::sync::Mutex::new(None);
    move |query| {
        let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.is_none() {
            let c = Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .and_then(|c| c.busy_timeout(std::time::Duration::from_secs(5)).map(|_| c));
            match c {
                Ok(c) => *conn = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open the store for reading");
                    return None;
                }
            }
        }
        match query(conn.as_ref()?) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the store");
                *conn = None;
                None
            }
        }
    }
}

/// The point reads of an SQLite store ([`crate::store::Reads`]). Lookups by id and
/// by key each go through a read-only connection of their own (see
/// `read_only`), so neither waits for the other; a `previous_response_id`
/// history opens one per read, as such reads are rare and may be long.
pub struct SqliteReads {
    path: std::path::PathBuf,
    compaction: Runner<Compaction>,
    key: Runner<String>,
}

/// A [`read_only`] query runner, boxed.
type Runner<T> = Box<dyn Fn(&Query<'_, T>) -> Option<T> + Send + Sync>;

impl SqliteReads {
    /// Reads of the store at `path`; nothing is opened until a read.
    pub fn new(path: &Path) -> Self {
        SqliteReads {
            path: path.to_path_buf(),
            compaction: Box::new(read_only(path.to_path_buf())),
            key: Box::new(read_only(path.to_path_buf())),
        }
    }
}

impl SqliteReads {
    /// The database these reads open.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

impl Reads for SqliteReads {
    fn compaction(&self, id: &str) -> Option<Compaction> {
        (self.compaction)(&|conn| load_compaction(conn, id))
    }

    fn conversation_of_key(&self, tenant: &str, key: &str) -> Option<String> {
        (self.key)(&|conn| {
            conn.query_row(
                "SELECT id FROM conversations WHERE tenant = ?1 AND explicit_key = ?2",
                params![tenant, key],
                |r| r.get(0),
            )
            .optional()
            .map_err(StoreError::from)
        })
    }

    fn response_history(&self, tenant: &str, response_id: &str) -> Option<Vec<serde_json::Value>> {
        let conn =
            Connection::open_with_flags(&self.path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .ok()?;
        response_history(&conn, tenant, response_id).ok().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::journal::tests::record;

    type ConversationRow = (String, String, Option<String>, i64, i64, String);

    fn conversations(b: &SqliteBackend) -> Vec<ConversationRow> {
        let mut stmt = b
            .conn
            .prepare(
                "SELECT id, tenant, explicit_key, created_ms, last_seen_ms, model
                 FROM conversations ORDER BY id",
            )
            .unwrap();
        stmt.query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
    }

    #[test]
    fn a_batch_records_its_conversations_as_writes_one_by_one_would() {
        let exchange = |id: i64, conversation: &str, started_ms: i64, model: &str, key: &str| {
            let mut r = record(id);
            r.conversation = conversation.into();
            r.started_ms = started_ms;
            r.model = model.into();
            r.explicit_key = Some(key.into());
            Record::Exchange(Box::new(r))
        };
        let before = [exchange(1, "conv_a", 5, "m0", "k0")];
        let batch = [
            exchange(2, "conv_a", 10, "m1", "k1"),
            exchange(3, "conv_b", 20, "m2", "k2"),
            exchange(4, "conv_a", 30, "m3", "k3"),
            exchange(5, "conv_c", 40, "m4", "k4"),
            exchange(6, "conv_c", 35, "m5", "k5"),
        ];
        let dir = tempfile::tempdir().unwrap();
        let mut one_by_one = SqliteBackend::open(&dir.path().join("a.db")).unwrap();
        let mut at_once = SqliteBackend::open(&dir.path().join("b.db")).unwrap();
        one_by_one.write(&before).unwrap();
        at_once.write(&before).unwrap();
        for rec in &batch {
            one_by_one.write(std::slice::from_ref(rec)).unwrap();
        }
        at_once.write(&batch).unwrap();
        let rows = conversations(&at_once);
        assert_eq!(rows, conversations(&one_by_one));
        assert_eq!(rows.len(), 3);
        assert_eq!(
            rows[0],
            (
                "conv_a".into(),
                "t".into(),
                Some("k0".into()),
                5,
                30,
                "m3".into()
            )
        );
        let count = |b: &SqliteBackend| {
            b.conn
                .query_row("SELECT COUNT(*) FROM exchanges", [], |r| r.get::<_, i64>(0))
                .unwrap()
        };
        assert_eq!(count(&at_once), 6);
    }

    #[test]
    fn start_up_loads_the_newest_exchanges_and_items_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = SqliteBackend::open(&dir.path().join("s.db")).unwrap();
        // Each exchange stores one new item of its own.
        let batch: Vec<Record> = (1..=6)
            .map(|id| Record::Exchange(Box::new(record(id))))
            .collect();
        b.write(&batch).unwrap();
        let snap = b.load_newest(2, 3, 10).unwrap();
        let ids: Vec<i64> = snap.exchanges.iter().map(|e| e.id).collect();
        assert_eq!(ids, [4, 5, 6], "the newest, oldest first");
        assert_eq!(snap.max_exchange_id, 6);
        let mut items = snap.item_hashes.clone();
        items.sort();
        let mut newest = [record(5).new_items[0].0, record(6).new_items[0].0];
        newest.sort();
        assert_eq!(items, newest);
        let all = b.load(crate::conversation::STORE_LIMITS).unwrap();
        assert_eq!(all.exchanges.len(), 6);
        assert_eq!(all.item_hashes.len(), 6);
        assert!(snap.keys.is_empty() && !snap.keys_truncated);
    }

    #[test]
    fn a_key_another_conversation_holds_does_not_fail_the_batch() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = SqliteBackend::open(&dir.path().join("s.db")).unwrap();
        let keyed = |id: i64, conversation: &str| {
            let mut r = record(id);
            r.conversation = conversation.into();
            r.explicit_key = Some("session".into());
            Record::Exchange(Box::new(r))
        };
        b.write(&[keyed(1, "conv_a")]).unwrap();
        b.write(&[keyed(2, "conv_b"), keyed(3, "conv_a")]).unwrap();
        let rows = conversations(&b);
        assert_eq!(rows.len(), 2, "both kept, with their exchanges");
        assert_eq!(
            rows[0].2.as_deref(),
            Some("session"),
            "the first keeps the key"
        );
        assert_eq!(rows[1].2, None);
        let count: i64 = b
            .conn
            .query_row("SELECT COUNT(*) FROM exchanges", [], |r| r.get(0))
            .unwrap();
        assert_eq!(count, 3);
    }

    #[test]
    fn start_up_loads_the_most_recently_seen_keys_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = SqliteBackend::open(&dir.path().join("s.db")).unwrap();
        let keyed = |id: i64, key: &str, seen: i64| {
            let mut r = record(id);
            r.explicit_key = Some(key.into());
            r.started_ms = seen;
            Record::Exchange(Box::new(r))
        };
        b.write(&[
            keyed(1, "old", 10),
            keyed(2, "newer", 30),
            keyed(3, "new", 20),
        ])
        .unwrap();
        let snap = b.load_newest(10, 10, 2).unwrap();
        let keys: Vec<&str> = snap.keys.iter().map(|(_, k, _)| k.as_str()).collect();
        assert_eq!(keys, ["new", "newer"], "the two seen last, oldest first");
        assert!(snap.keys_truncated);
        let all = b.load_newest(10, 10, 3).unwrap();
        assert_eq!(all.keys.len(), 3);
        assert!(!all.keys_truncated);
    }

    #[test]
    fn a_store_of_the_schema_before_client_ids_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        {
            // A file as the schema before these columns made it, with a
            // conversation and an exchange in it.
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(include_str!("testdata/schema_before_client_ids.sql"))
                .unwrap();
            conn.execute_batch(
                "INSERT INTO conversations (id, tenant, explicit_key, created_ms, last_seen_ms, model)
                 VALUES ('conv_old', 't', NULL, 1, 2, 'm');
                 INSERT INTO exchanges (id, conversation_id, tenant, endpoint, model, suffix_items,
                     request_len, params, response_items, status, streamed, partial, started_ms,
                     latency_ms)
                 VALUES (1, 'conv_old', 't', '/chat/completions', 'm', x'', 0, x'', x'', 200, 0, 0,
                     1, 0.5);",
            )
            .unwrap();
        }
        let mut b = SqliteBackend::open(&path).unwrap();
        let columns = |table: &str| -> Vec<String> {
            let mut stmt = b
                .conn
                .prepare(&format!("PRAGMA table_info({table})"))
                .unwrap();
            stmt.query_map([], |r| r.get(1))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
        };
        for (table, column, _) in ADDED_COLUMNS {
            assert!(
                columns(table).iter().any(|c| c == column),
                "{table}.{column}"
            );
        }
        let snap = b.load(crate::conversation::STORE_LIMITS).unwrap();
        assert_eq!(snap.exchanges.len(), 1, "the old exchange is still read");
        // The old rows have nothing in the new columns; new ones do.
        let mut new = record(2);
        new.conversation = "conv_old".into();
        new.new_conversation = false;
        b.write(&[Record::Exchange(Box::new(new))]).unwrap();
        type Row = (
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
        );
        let conversation: Row = b
            .conn
            .query_row(
                "SELECT preview, client, conversation_header, prompt_cache_key
                 FROM conversations WHERE id = 'conv_old'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(
            conversation,
            (
                Some("Count to 2.".into()),
                Some("codex_cli_rs/0.1".into()),
                Some("my-session".into()),
                Some("cache".into())
            )
        );
        let windows: Vec<(Option<i64>, Option<String>, Option<String>)> = b
            .conn
            .prepare("SELECT context_window, window_source, client FROM exchanges ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            windows,
            [
                (None, None, None),
                (
                    Some(4096),
                    Some("discovered".into()),
                    Some("codex_cli_rs/0.1".into())
                )
            ]
        );
        // Opening again finds nothing left to add.
        drop(b);
        SqliteBackend::open(&path).unwrap();
    }

    /// A database of the schema before audits: its compactions are read
    /// back without one, and a new compaction keeps its audit.
    #[test]
    fn a_store_of_the_schema_before_audits_is_migrated() {
        use crate::compaction::summary::{Audit, AuditedFact, FactKind, FactState};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(include_str!("testdata/schema_before_audit.sql"))
                .unwrap();
            conn.execute_batch(
                "INSERT INTO compactions (id, tenant, conversation_id, covered_len, covered_chain,
                     replacement, rung, reason, tokens_before, tokens_after, items_removed,
                     items_kept, summary, facts, base_id, summary_calls, duration_ms, created_ms)
                 VALUES ('cmp_old', 't', 'conv_old', 3, zeroblob(32), '[]', 'prune', 'manual',
                     100, 10, 2, 1, NULL, NULL, NULL, 0, 1, 1);",
            )
            .unwrap();
        }
        let mut b = SqliteBackend::open(&path).unwrap();
        let old = load_compaction(&b.conn, "cmp_old").unwrap().unwrap();
        assert_eq!(old.audit, None, "an old compaction has no audit");
        assert_eq!(
            old.summary_cache,
            Default::default(),
            "nor summary cache figures: priced uncached"
        );
        let mut c = crate::compaction::test_compaction("cmp_new", "t", 3, [1; 32], vec![]);
        c.summary_cache = crate::compaction::SummaryCache {
            read: 900,
            write: 80,
            write_1h: 20,
        };
        c.audit = Some(Audit {
            facts: vec![AuditedFact {
                kind: FactKind::Constraint,
                fact: "Never change the cookie name.".into(),
                state: FactState::Forgotten,
            }],
            removed: vec!["item:0123456789abcdef".into()],
            removed_count: 1,
        });
        b.write(&[Record::Compaction(Box::new(c.clone()))]).unwrap();
        let back = load_compaction(&b.conn, "cmp_new").unwrap().unwrap();
        assert_eq!(back.audit, c.audit);
        assert_eq!(back.summary_cache, c.summary_cache);
        drop(b);
        SqliteBackend::open(&path).unwrap();
    }

    /// A database from before exchanges kept their cache writes gets the
    /// columns; an exchange written then keeps what its upstream reported.
    #[test]
    fn a_store_of_the_schema_before_cache_writes_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch(include_str!("testdata/schema_before_audit.sql"))
            .unwrap();
        let mut b = SqliteBackend::open(&path).unwrap();
        let mut r = record(1);
        r.usage = Some(crate::wire::Usage {
            input_tokens: 100,
            output_tokens: 5,
            cached_tokens: Some(10),
            cache_write_tokens: Some(80),
            cache_write_1h_tokens: Some(20),
        });
        b.write(&[Record::Exchange(Box::new(r))]).unwrap();
        let got: (i64, i64) = b
            .conn
            .query_row(
                "SELECT cache_write_tokens, cache_write_1h_tokens FROM exchanges",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(got, (80, 20));
    }

    #[test]
    fn a_conversation_keeps_its_first_preview_and_its_latest_client_and_ids() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = SqliteBackend::open(&dir.path().join("s.db")).unwrap();
        let exchange =
            |id: i64, preview: Option<&str>, client: Option<&str>, session: Option<&str>| {
                let mut r = record(id);
                r.conversation = "conv_a".into();
                r.preview = preview.map(String::from);
                r.client = client.map(String::from);
                r.client_ids = crate::store::ClientIds {
                    session: session.map(String::from),
                    ..Default::default()
                };
                Record::Exchange(Box::new(r))
            };
        b.write(&[
            exchange(1, Some("first"), Some("a/1"), None),
            exchange(2, Some("second"), None, Some("s1")),
        ])
        .unwrap();
        b.write(&[exchange(3, Some("third"), Some("b/2"), None)])
            .unwrap();
        let row: (String, String, String) = b
            .conn
            .query_row(
                "SELECT preview, client, session_id FROM conversations WHERE id = 'conv_a'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!(row, ("first".into(), "b/2".into(), "s1".into()));
    }
}
