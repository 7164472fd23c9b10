//! The PostgreSQL backend: records shared by every replica given the same
//! database, so that a conversation whose requests land on several
//! processes stays one conversation.
//!
//! The store's interface is blocking (a writer thread, point reads from
//! any thread), the driver is async: the backend runs its own small tokio
//! runtime, and every call is a future run there and waited for. The
//! writer thread commits each batch in one transaction: exchanges that end
//! together share one commit (the group commit), and an exchange's answer
//! is released only once its commit is done, since there is no journal.
//!
//! What must be unique across replicas is decided by the database: item
//! bodies are inserted once (`ON CONFLICT DO NOTHING`), the tenant salt is
//! the first replica's, exchange ids come from a sequence in blocks, an
//! explicit key belongs to the conversation that committed it first.
//!
//! A commit under way longer than `store.stall_after_ms`, or a last one
//! that failed for want of the database, marks it stalled
//! ([`super::SharedDatabase::stalled`]): requests are refused before they go
//! upstream until a commit (an empty one tried every 250 ms after
//! a failure) succeeds. A batch the database refuses for a value one record
//! holds goes again record by record; text is stored escaped
//! ([`super::postgres_text`]), since PostgreSQL's refuses U+0000; the
//! exchanges of a commit that timed out are written again as withheld with
//! the next batch, whatever became of that commit.

use std::borrow::Cow;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::types::Type;
use tokio_postgres::NoTls;

use super::postgres_text::{escape, escape_opt, unescape, unescape_opt};
use super::rows::COMPACTION_COLUMNS;
use super::sql::{Cell, Row};
use super::{
    AttemptRecord, Backend, ChainHit, ExchangeRecord, Found, IndexedExchange, Limits, LookUp,
    PrefixRef, ReadFuture, Record, Snapshot, StoreError, StoredCompaction,
};
use crate::compaction::Compaction;
use crate::config::StoreConfig;
use crate::windows::{Source, Told};
use crate::wire::ItemHash;

/// The schema's versions, oldest first: each is applied once, in its own
/// transaction, and recorded in `schema_migrations`. A change to the schema
/// is a new entry, never an edit of an old one.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value BYTEA NOT NULL
);
-- Each distinct item (message, tool output, request parameters…) once,
-- whichever replica saw it first.
CREATE TABLE items (
    hash BYTEA PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE conversations (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    explicit_key TEXT,
    created_ms   BIGINT NOT NULL,
    last_seen_ms BIGINT NOT NULL,
    model        TEXT NOT NULL DEFAULT '',
    -- Its first user message (redacted, bounded), the client of its latest
    -- exchange, and the latest ids the client sent for it.
    preview             TEXT,
    client              TEXT,
    conversation_header TEXT,
    session_id          TEXT,
    prompt_cache_key    TEXT
);
CREATE UNIQUE INDEX conversations_key
    ON conversations (tenant, explicit_key) WHERE explicit_key IS NOT NULL;
CREATE INDEX conversations_seen ON conversations (last_seen_ms);
-- Exchange ids are handed out in blocks (see ID_BLOCK).
CREATE SEQUENCE exchange_id_blocks;
CREATE TABLE exchanges (
    id              BIGINT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id),
    tenant          TEXT NOT NULL,
    endpoint        TEXT NOT NULL,
    model           TEXT NOT NULL,
    prefix_exchange BIGINT,
    prefix_len      BIGINT NOT NULL DEFAULT 0,
    prefix_full     BOOLEAN NOT NULL DEFAULT FALSE,
    suffix_items    BYTEA NOT NULL,
    request_len     BIGINT NOT NULL,
    params          BYTEA NOT NULL,
    response_items  BYTEA NOT NULL,
    response_id     TEXT,
    input_tokens    BIGINT,
    output_tokens   BIGINT,
    cached_tokens   BIGINT,
    status          INTEGER NOT NULL,
    streamed        BOOLEAN NOT NULL,
    partial         BOOLEAN NOT NULL,
    error           TEXT,
    started_ms      BIGINT NOT NULL,
    latency_ms      DOUBLE PRECISION NOT NULL,
    ttfb_ms         DOUBLE PRECISION,
    chain_request   BYTEA,
    chain_full      BYTEA,
    compaction_id   TEXT,
    -- The window the request was measured against, and its source; the
    -- client and the ids it sent.
    context_window      BIGINT,
    window_source       TEXT,
    client              TEXT,
    conversation_header TEXT,
    session_id          TEXT,
    prompt_cache_key    TEXT
);
CREATE INDEX exchanges_conversation ON exchanges (conversation_id, id);
-- Whether an exchange is its conversation's tip (nothing continued it).
CREATE INDEX exchanges_prefix ON exchanges (prefix_exchange)
    WHERE prefix_exchange IS NOT NULL;
-- What a replica that has not seen a conversation looks it up by.
CREATE INDEX exchanges_chain_request ON exchanges (tenant, chain_request)
    WHERE chain_request IS NOT NULL;
CREATE INDEX exchanges_chain_full ON exchanges (tenant, chain_full)
    WHERE chain_full IS NOT NULL;
CREATE INDEX exchanges_response ON exchanges (tenant, response_id)
    WHERE response_id IS NOT NULL;
CREATE TABLE compactions (
    id              TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    covered_len     BIGINT NOT NULL,
    covered_chain   BYTEA NOT NULL,
    replacement     TEXT NOT NULL,
    rung            TEXT NOT NULL,
    reason          TEXT NOT NULL,
    tokens_before   BIGINT NOT NULL,
    tokens_after    BIGINT NOT NULL,
    items_removed   BIGINT NOT NULL,
    items_kept      BIGINT NOT NULL,
    summary         TEXT,
    facts           TEXT,
    base_id         TEXT,
    summary_calls   BIGINT NOT NULL,
    duration_ms     BIGINT NOT NULL,
    created_ms      BIGINT NOT NULL,
    summary_tokens  BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX compactions_conversation ON compactions (tenant, conversation_id, created_ms);
CREATE INDEX compactions_chain ON compactions (tenant, covered_chain);
CREATE TABLE windows (
    upstream   TEXT NOT NULL,
    model      TEXT NOT NULL,
    "window"   BIGINT NOT NULL,
    source     TEXT NOT NULL,
    updated_ms BIGINT NOT NULL,
    PRIMARY KEY (upstream, model)
);
-- Who computes a conversation's compaction now, until when: a replica
-- that dies mid-compaction leaves a claim that expires.
CREATE TABLE compaction_claims (
    tenant          TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    owner           TEXT NOT NULL,
    expires_ms      BIGINT NOT NULL,
    PRIMARY KEY (tenant, conversation_id)
);
"#,
    ),
    (
        2,
        r#"
-- Observe mode's would-be compactions are recorded but never applied;
-- what each compaction and exchange saved, for the savings accounting.
ALTER TABLE compactions
    ADD COLUMN observed              BOOLEAN NOT NULL DEFAULT false,
    ADD COLUMN summary_output_tokens BIGINT  NOT NULL DEFAULT 0,
    ADD COLUMN tokens_saved          BIGINT  NOT NULL DEFAULT 0;
ALTER TABLE exchanges
    ADD COLUMN mode                   TEXT   NOT NULL DEFAULT 'auto',
    ADD COLUMN tokens_saved           BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN tokens_saved_potential BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN observed_compaction    TEXT,
    ADD COLUMN recall_rounds          BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN recall_input_tokens    BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN recall_output_tokens   BIGINT NOT NULL DEFAULT 0;
"#,
    ),
    (
        3,
        r#"
-- Manual compactions asked for and not yet applied, whichever replica was
-- asked: the replica that serves the conversation's next request deletes
-- the row, and only one can (see postgres_listen).
CREATE TABLE manual_compactions (
    conversation_id TEXT PRIMARY KEY REFERENCES conversations(id) ON DELETE CASCADE,
    tenant          TEXT NOT NULL,
    requested_ms    BIGINT NOT NULL
);
"#,
    ),
    (
        4,
        r#"
-- A conversation's timeline in the order it happened: replicas hand out
-- exchange ids in blocks, so ids interleave across them.
CREATE INDEX exchanges_timeline ON exchanges (conversation_id, started_ms, id);
"#,
    ),
    (
        5,
        r#"
-- The latest compaction attempt of a conversation that stored nothing
-- (discarded, failed), whichever replica made it: `compact` asks any.
CREATE TABLE compaction_attempts (
    conversation_id TEXT PRIMARY KEY REFERENCES conversations(id) ON DELETE CASCADE,
    tenant          TEXT NOT NULL,
    at_ms           BIGINT NOT NULL,
    result          TEXT NOT NULL,
    tokens_before   BIGINT,
    tokens_after    BIGINT,
    error           TEXT
);
"#,
    ),
    (
        6,
        r#"
-- Each compaction's facts checklist and the items it removed, as JSON
-- (NULL for one stored before audits were kept).
ALTER TABLE compactions ADD COLUMN audit TEXT;
"#,
    ),
    (
        7,
        r#"
-- Every compaction stored is announced, with what finding it needs
-- (see Postgres::announced): a replica that hears them all need not ask
-- for a conversation's newest.
CREATE FUNCTION compactor_announce_compaction() RETURNS trigger AS $$
BEGIN
    IF NOT NEW.observed THEN
        PERFORM pg_notify('compactor_compacted', concat_ws(' ', NEW.tenant, NEW.id,
            NEW.covered_len, encode(NEW.covered_chain, 'hex'), NEW.created_ms,
            NEW.conversation_id));
    END IF;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER compactions_announced AFTER INSERT ON compactions
    FOR EACH ROW EXECUTE PROCEDURE compactor_announce_compaction();
"#,
    ),
];

/// The key of the advisory lock migrations run under, so that replicas
/// starting together apply each migration once.
const MIGRATION_LOCK: i64 = 0x636f_6d70_6163_7401;

/// Exchange ids one `nextval` reserves for a process: ids stay unique
/// across replicas with one round trip per this many exchanges.
const ID_BLOCK: i64 = 1024;

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Threads of the backend's runtime: the driver's work is I/O, the callers
/// wait on their own threads.
const RUNTIME_THREADS: usize = 2;

/// How to reach the database.
#[derive(Clone)]
pub struct Options {
    /// `postgres://…`
    pub url: String,
    /// From the URL, `PGPASSWORD` or `password_env` (never logged).
    pub password: Option<String>,
    /// Most connections the pool keeps.
    pub pool_size: usize,
    /// Statement timeout, and the longest wait for a pooled connection.
    pub statement_timeout: Duration,
    /// A commit under way longer than this declares the database stalled.
    pub stall_after: Duration,
    /// How long a claim on computing a conversation's compaction lasts.
    pub claim_lapse: Duration,
    /// The sessions' `synchronous_commit` (`on` unless set).
    pub synchronous_commit: Option<String>,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("stall_after", &self.stall_after)
            .finish_non_exhaustive()
    }
}

impl Options {
    /// The options `[store]` gives.
    pub fn from_config(c: &StoreConfig) -> Self {
        Options {
            url: c.url.clone(),
            password: c.password(),
            pool_size: c.pool_size,
            statement_timeout: Duration::from_millis(c.statement_timeout_ms),
            stall_after: Duration::from_millis(c.stall_after_ms),
            claim_lapse: Duration::from_secs(c.claim_lapse_secs),
            synchronous_commit: Some(c.synchronous_commit.clone()),
        }
    }

    fn pg_config(&self) -> Result<tokio_postgres::Config, StoreError> {
        let mut pg: tokio_postgres::Config = self.url.parse().map_err(StoreError::Postgres)?;
        if let Some(p) = &self.password {
            pg.password(p);
        }
        pg.connect_timeout(CONNECT_TIMEOUT);
        pg.application_name("compactor");
        let mut options = format!(
            "-c statement_timeout={}",
            self.statement_timeout.as_millis()
        );
        // Checked against the values PostgreSQL takes (config validation):
        // nothing else reaches the options string.
        if let Some(sync) = self
            .synchronous_commit
            .as_deref()
            .filter(|s| crate::config::SYNCHRONOUS_COMMIT.contains(s))
        {
            options.push_str(&format!(" -c synchronous_commit={sync}"));
        }
        pg.options(options);
        Ok(pg)
    }
}

/// Where the schema of a database stands, for `--check-config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaStatus {
    /// The newest migration applied (0: none).
    pub applied: i32,
    /// The newest this build knows.
    pub latest: i32,
}

impl SchemaStatus {
    /// Whether the database has every migration this build knows.
    pub fn is_current(&self) -> bool {
        self.applied >= self.latest
    }
}

/// A connection pool and the runtime its connections live on, shared by
/// the backend, its reads and the exchange ids.
pub struct Postgres {
    runtime: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    pub(super) pool: Pool,
    timeout: Duration,
    health: Arc<Health>,
    stall_after: Duration,
    claim_lapse: Duration,
    /// Round trips the reads made (see [`Postgres::reads`]).
    reads: std::sync::atomic::AtomicU64,
}

/// What tells a stalled database, kept by the writer's commits and read by
/// the request path without a round trip.
#[derive(Default)]
struct Health {
    /// Unix ms the commit under way started (0: none is).
    busy_since_ms: AtomicI64,
    /// The last commit failed for want of the database (not for a value it
    /// refused); cleared by the next commit that succeeds.
    failing: AtomicBool,
    /// A probe commit is being tried (see [`Postgres::probe_until_up`]).
    probing: AtomicBool,
}

/// How often a database whose last commit failed is tried again with an
/// empty commit, while no request is let through to commit one.
const PROBE_EVERY: Duration = Duration::from_millis(250);

impl Drop for Postgres {
    fn drop(&mut self) {
        // Dropped on an async thread too (the state of a server that
        // stops): a runtime may only be shut down there without blocking.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Postgres {
    /// The pool (no connection yet).
    pub fn new(opts: &Options) -> Result<Arc<Self>, StoreError> {
        // What can be refused is checked before the runtime exists: a
        // runtime dropped on an early return from inside the caller's async
        // context (`serve` opens the store there) would panic.
        let manager = Manager::from_config(
            opts.pg_config()?,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(opts.pool_size)
            .wait_timeout(Some(opts.statement_timeout))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::Pool(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("compactor-pg")
            .enable_all()
            .build()?;
        Ok(Arc::new(Postgres {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            pool,
            timeout: opts.statement_timeout + CONNECT_TIMEOUT,
            health: Arc::default(),
            stall_after: opts.stall_after,
            claim_lapse: opts.claim_lapse,
            reads: Default::default(),
        }))
    }

    /// Connects and applies the migrations the database lacks.
    pub fn open(opts: &Options) -> Result<Arc<Self>, StoreError> {
        let pg = Self::new(opts)?;
        let pool = pg.pool.clone();
        pg.wait(async move { migrate(&pool).await })?;
        Ok(pg)
    }

    /// Where the database's schema stands, without changing it.
    pub fn status(&self) -> Result<SchemaStatus, StoreError> {
        let pool = self.pool.clone();
        self.wait(async move {
            let client = pool.get().await?;
            Ok(SchemaStatus {
                applied: applied_version(&client).await?,
                latest: latest_version(),
            })
        })
    }

    /// Whether the database answers now.
    pub fn ping(&self) -> Result<(), StoreError> {
        let pool = self.pool.clone();
        self.wait(async move {
            pool.get().await?.simple_query("SELECT 1").await?;
            Ok(())
        })
    }

    /// The pool's connections: (open, idle, callers waiting for one).
    pub fn pool_status(&self) -> (usize, usize, usize) {
        let s = self.pool.status();
        (s.size, s.available, s.waiting)
    }

    /// Runs `fut` on the backend's runtime and waits for it, bounded in
    /// time, from any thread: an async caller's thread blocks as on an
    /// SQLite read.
    pub(super) fn wait<T, F>(&self, fut: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let timeout = self.timeout;
        let bounded = async move {
            tokio::time::timeout(timeout, fut)
                .await
                .unwrap_or(Err(StoreError::Timeout))
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return self.handle.block_on(bounded);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(bounded.await);
        });
        let wait = || rx.recv().map_err(|_| StoreError::Closed)?;
        // Called from a request's task: the round trip must not stall the
        // other tasks of that worker, so they move to another thread while
        // this one waits (a current-thread runtime cannot, and just waits).
        match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(wait),
            _ => wait(),
        }
    }

    /// Notes how the commit under way ended: a failure for want of the
    /// database stalls the store until a probe commit succeeds.
    fn committed(&self, result: &Result<(), StoreError>) {
        self.health.busy_since_ms.store(0, Ordering::Release);
        let down = result.as_ref().is_err_and(|e| !e.is_refusal());
        self.health.failing.store(down, Ordering::Release);
        if down {
            self.probe_until_up();
        }
    }

    /// Tries an empty commit every [`PROBE_EVERY`] until one succeeds,
    /// which clears the failure: requests are refused meanwhile, so none
    /// would commit to tell it. One prober at a time.
    fn probe_until_up(&self) {
        if self.health.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (pool, health, timeout) = (self.pool.clone(), self.health.clone(), self.timeout);
        self.handle.spawn(async move {
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                if !health.failing.load(Ordering::Acquire) {
                    break;
                }
                let probe = async {
                    let client = pool.get().await?;
                    client.batch_execute("BEGIN; COMMIT").await?;
                    Ok::<_, StoreError>(())
                };
                if let Ok(Ok(())) = tokio::time::timeout(timeout, probe).await {
                    tracing::info!("the database answers again: requests are served");
                    health.failing.store(false, Ordering::Release);
                    break;
                }
            }
            health.probing.store(false, Ordering::Release);
        });
    }

    /// A new block of exchange ids, unique across every replica.
    pub fn reserve_ids(&self) -> Result<std::ops::Range<i64>, StoreError> {
        let pool = self.pool.clone();
        self.wait(async move {
            let client = pool.get().await?;
            let row = client
                .query_one("SELECT nextval('exchange_id_blocks')", &[])
                .await?;
            let block: i64 = row.get(0);
            Ok(block * ID_BLOCK..(block + 1) * ID_BLOCK)
        })
    }
}

impl super::SharedDatabase for Postgres {
    fn reserve_ids(&self) -> Result<std::ops::Range<i64>, StoreError> {
        Postgres::reserve_ids(self)
    }

    fn stalled(&self) -> Option<StoreError> {
        if self.health.failing.load(Ordering::Acquire) {
            return Some(StoreError::Stalled(
                "the last commit failed; waiting for one to succeed".into(),
            ));
        }
        let since = self.health.busy_since_ms.load(Ordering::Acquire);
        let age = crate::ids::now_ms() - since;
        (since > 0 && age >= self.stall_after.as_millis() as i64)
            .then(|| StoreError::Stalled(format!("a commit has been under way for {age} ms")))
    }
}

fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |(v, _)| *v)
}

async fn applied_version(client: &tokio_postgres::Client) -> Result<i32, StoreError> {
    let exists: bool = client
        .query_one("SELECT to_regclass('schema_migrations') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let row = client
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// Applies the migrations the database lacks, under an advisory lock: a
/// replica starting meanwhile waits, then finds them applied.
async fn migrate(pool: &Pool) -> Result<(), StoreError> {
    let mut client = pool.get().await?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    let result = apply_migrations(&mut client).await;
    // Unlocked whatever happened: the lock is the session's, and the
    // session goes back to the pool.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await;
    result?;
    unlocked?;
    Ok(())
}

async fn apply_migrations(client: &mut deadpool_postgres::Object) -> Result<(), StoreError> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                 version    INTEGER PRIMARY KEY,
                 applied_ms BIGINT NOT NULL
             )",
        )
        .await?;
    let applied = applied_version(client).await?;
    if applied > latest_version() {
        tracing::warn!(
            applied,
            known = latest_version(),
            "the database's schema is newer than this build's"
        );
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > applied) {
        let tx = client.transaction().await?;
        tx.batch_execute(sql).await?;
        tx.execute(
            "INSERT INTO schema_migrations (version, applied_ms) VALUES ($1, $2)",
            &[version, &crate::ids::now_ms()],
        )
        .await?;
        tx.commit().await?;
        tracing::info!(version, "database schema migrated");
    }
    Ok(())
}

/// The writer thread's side: batches in one transaction each.
pub struct PostgresBackend {
    pg: Arc<Postgres>,
    /// The exchanges of batches whose commit timed out after their
    /// pipeline may have been sent, as their clients were answered
    /// (withheld, see [`withheld`]): written with the next batch, whether
    /// the timed-out commit landed meanwhile, lands later or never.
    in_doubt: Vec<Record>,
}

impl PostgresBackend {
    /// The writer's backend over `pg`.
    pub fn new(pg: Arc<Postgres>) -> Self {
        PostgresBackend {
            pg,
            in_doubt: Vec::new(),
        }
    }
}

/// What an exchange whose commit timed out is recorded with: its client
/// was told the answer was withheld.
pub const WITHHELD: &str = "the answer was withheld: its commit did not finish in time";

/// `rec` as recorded once its answer was withheld: a 503, its response not
/// one a later request can continue.
fn withheld(rec: &Record) -> Option<Record> {
    let Record::Exchange(e) = rec else {
        return None;
    };
    let mut e = e.clone();
    e.status = 503;
    e.partial = true;
    e.error = Some(WITHHELD.into());
    e.response_id = None;
    e.chain_full = None;
    Some(Record::Exchange(e))
}

fn hash_of(bytes: Option<Vec<u8>>) -> Option<ItemHash> {
    bytes.and_then(|b| b.as_slice().try_into().ok())
}

impl Backend for PostgresBackend {
    fn load(&mut self, limits: Limits) -> Result<Snapshot, StoreError> {
        let pool = self.pg.pool.clone();
        self.pg.wait(async move { load(&pool, limits).await })
    }

    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        // The writer thread is outside any runtime: the batch is written
        // where it is, without a copy (but after a timeout, when what was in
        // doubt goes first, in the same transaction).
        let pool = self.pg.pool.clone();
        let timeout = self.pg.timeout;
        self.pg
            .health
            .busy_since_ms
            .store(crate::ids::now_ms(), Ordering::Release);
        let doubt = std::mem::take(&mut self.in_doubt);
        let ids: Vec<i64> = doubt
            .iter()
            .filter_map(|r| match r {
                Record::Exchange(e) => Some(e.id),
                _ => None,
            })
            .collect();
        let joined: Vec<Record>;
        let records = if doubt.is_empty() {
            batch
        } else {
            joined = doubt.iter().chain(batch).cloned().collect();
            &joined
        };
        let result = self
            .pg
            .handle
            .block_on(async { write(&pool, records, &ids, timeout).await });
        match &result {
            Ok(()) => {
                if !ids.is_empty() {
                    tracing::warn!(
                        exchanges = ids.len(),
                        "exchanges whose commit timed out are recorded as withheld"
                    );
                }
            }
            // Its pipeline may have been sent: the database may yet commit
            // it. Its clients are told it failed, so the next batch records
            // them so, whatever the database did with it.
            Err(StoreError::Timeout) => {
                self.in_doubt = doubt;
                self.in_doubt.extend(batch.iter().filter_map(withheld));
            }
            Err(_) => self.in_doubt = doubt,
        }
        self.pg.committed(&result);
        result
    }
}

async fn load(pool: &Pool, limits: Limits) -> Result<Snapshot, StoreError> {
    let client = pool.get().await?;
    let mut snap = Snapshot::default();
    let mut salt = [0u8; 32];
    getrandom::fill(&mut salt).map_err(|e| StoreError::Io(std::io::Error::other(e.to_string())))?;
    // The first replica's salt stays: the others read it.
    client
        .execute(
            "INSERT INTO meta (key, value) VALUES ('tenant_salt', $1) ON CONFLICT DO NOTHING",
            &[&salt.as_slice()],
        )
        .await?;
    let stored: Vec<u8> = client
        .query_one("SELECT value FROM meta WHERE key = 'tenant_salt'", &[])
        .await?
        .get(0);
    snap.salt = stored
        .as_slice()
        .try_into()
        .map_err(|_| StoreError::Pool("the stored tenant salt is not 32 bytes".into()))?;
    let rows = client
        .query(
            "SELECT id, conversation_id, tenant, request_len, length(response_items) / 32,
                    chain_request, chain_full, response_id, prefix_exchange
             FROM exchanges ORDER BY id DESC LIMIT $1",
            &[&(limits.exchanges as i64)],
        )
        .await?;
    snap.exchanges = rows
        .iter()
        .map(|r| IndexedExchange {
            id: r.get(0),
            conversation: r.get(1),
            tenant: r.get(2),
            request_len: r.get::<_, i64>(3) as usize,
            response_len: r.get::<_, i32>(4) as usize,
            chain_request: hash_of(r.get(5)),
            chain_full: hash_of(r.get(6)),
            response_id: unescape_opt(r.get(7)),
            prefix_exchange: r.get(8),
        })
        .collect();
    snap.exchanges.reverse();
    let rows = client
        .query(
            "SELECT tenant, explicit_key, id FROM conversations WHERE explicit_key IS NOT NULL
             ORDER BY last_seen_ms DESC, id DESC LIMIT $1",
            &[&(limits.keys as i64 + 1)],
        )
        .await?;
    snap.keys = rows
        .iter()
        .map(|r| (r.get(0), unescape(r.get(1)), r.get(2)))
        .collect();
    snap.keys_truncated = snap.keys.len() > limits.keys;
    snap.keys.truncate(limits.keys);
    snap.keys.reverse();
    let rows = client
        .query(
            "SELECT id, tenant, conversation_id, covered_len, covered_chain, created_ms, observed
             FROM compactions ORDER BY created_ms, id",
            &[],
        )
        .await?;
    snap.compactions = rows.iter().map(stored_compaction).collect();
    let rows = client
        .query(
            r#"SELECT upstream, model, "window", source, updated_ms FROM windows
               ORDER BY upstream, model"#,
            &[],
        )
        .await?;
    snap.windows = rows
        .iter()
        .map(|r| Told {
            upstream: unescape(r.get(0)),
            model: unescape(r.get(1)),
            window: r.get::<_, i64>(2).max(0) as u64,
            source: Source::parse(r.get(3)).unwrap_or(Source::Learned),
            updated_ms: r.get(4),
        })
        .collect();
    Ok(snap)
}

fn stored_compaction(r: &tokio_postgres::Row) -> StoredCompaction {
    StoredCompaction {
        id: r.get(0),
        tenant: r.get(1),
        conversation: r.get(2),
        covered_len: r.get::<_, i64>(3) as usize,
        covered_chain: hash_of(r.get(4)).unwrap_or([0; 32]),
        created_ms: r.get(5),
        observed: r.get(6),
    }
}

/// Writes a batch in one transaction, sent as one pipeline: `BEGIN`, one
/// multi-row statement per table, `COMMIT`, all before any answer is
/// awaited, so that a commit costs one round trip however many records it
/// holds. Under load a round trip is mostly the wait for the threads at
/// either end to be scheduled, so the count of them, not of rows, is what
/// a commit's time grows with.
///
/// `withheld` are exchanges of the batch recorded so after an earlier
/// commit of theirs timed out: should that commit have landed first (the
/// batch's inserts then leave its rows), they are marked so in the same
/// transaction; should it land later, its inserts find theirs and leave
/// them. A commit still running holds their ids, and the inserts wait for
/// it.
async fn write(
    pool: &Pool,
    batch: &[Record],
    withheld: &[i64],
    timeout: Duration,
) -> Result<(), StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let client = tokio::time::timeout_at(deadline, pool.get())
        .await
        .map_err(|_| StoreError::Timeout)??;
    let written = tokio::time::timeout_at(deadline, write_pipelined(&client, batch, withheld))
        .await
        .unwrap_or(Err(StoreError::Timeout));
    if written.is_err() {
        // A statement that failed before it was sent (its parameters could
        // not be encoded) leaves the transaction open, without its COMMIT,
        // and one that timed out leaves answers due: the session is closed,
        // rather than handed to the pool's next user.
        drop(deadpool_postgres::Object::take(client));
    }
    written
}

/// Marks exchanges as withheld (see [`WITHHELD`]).
const MARK_WITHHELD: &str = "UPDATE exchanges SET status = 503, partial = TRUE, error = $2,
                                                  response_id = NULL, chain_full = NULL
                             WHERE id = ANY($1)";

/// Runs [`MARK_WITHHELD`] over `ids`, unless there are none.
async fn mark_withheld(
    client: &deadpool_postgres::ClientWrapper,
    statement: &tokio_postgres::Statement,
    ids: &[i64],
) -> Result<u64, tokio_postgres::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    client.execute(statement, &[&ids, &WITHHELD]).await
}

async fn write_pipelined(
    client: &deadpool_postgres::ClientWrapper,
    batch: &[Record],
    withheld: &[i64],
) -> Result<(), StoreError> {
    let spans = super::conversation_spans(batch);
    let mut items = Items::default();
    let mut keyed = KeyedConversations::default();
    let mut seen = SeenConversations::default();
    let mut exchanges = Exchanges::default();
    let mut compactions = Compactions::default();
    let mut windows = Windows::default();
    for span in &spans {
        if span.1.first.explicit_key.is_some() {
            keyed.push(span);
        }
        seen.push(span);
    }
    for rec in batch {
        match rec {
            Record::Exchange(e) => {
                e.new_items.iter().for_each(|item| items.push(item));
                exchanges.push(e);
            }
            Record::Compaction(c) => compactions.push(c),
            Record::Window(_) => {}
        }
    }
    // One row per (upstream, model), the batch's last: as when each was
    // upserted in turn (one statement may not update a row twice).
    let mut told = foldhash::HashSet::default();
    let mut latest: Vec<&Told> = batch
        .iter()
        .rev()
        .filter_map(|r| match r {
            Record::Window(w) => told.insert((&w.upstream, &w.model)).then_some(w),
            _ => None,
        })
        .collect();
    latest.reverse();
    latest.into_iter().for_each(|w| windows.push(w));
    // Prepared once per connection (cached by the pool), all at once.
    let statements = tokio::try_join!(
        client.prepare_cached(Items::sql()),
        client.prepare_cached(KeyedConversations::sql()),
        client.prepare_cached(SeenConversations::sql()),
        client.prepare_cached(Exchanges::sql()),
        client.prepare_cached(Compactions::sql()),
        client.prepare_cached(Windows::sql()),
        client.prepare_cached(MARK_WITHHELD),
    )?;
    // `biased`: each request is sent when first polled, so polled in this
    // order they run in it, the conversations before the exchanges that
    // refer to them. A failed statement aborts the transaction: what
    // follows it fails too, and the COMMIT rolls back.
    tokio::try_join!(
        biased;
        client.batch_execute("BEGIN"),
        insert(client, &statements.0, &items),
        insert(client, &statements.1, &keyed),
        insert(client, &statements.2, &seen),
        insert(client, &statements.3, &exchanges),
        insert(client, &statements.4, &compactions),
        insert(client, &statements.5, &windows),
        mark_withheld(client, &statements.6, withheld),
        client.batch_execute("COMMIT"),
    )?;
    Ok(())
}

/// Runs a multi-row statement over `rows`, unless there are none.
async fn insert<T: Columns>(
    client: &deadpool_postgres::ClientWrapper,
    statement: &tokio_postgres::Statement,
    rows: &T,
) -> Result<u64, tokio_postgres::Error> {
    if rows.is_empty() {
        return Ok(0);
    }
    client.execute(statement, &rows.params()).await
}

/// A table's rows held as one array per column, written by one
/// `INSERT … SELECT * FROM unnest($1::type[], …)`: one statement per table
/// however many rows, prepared once.
trait Columns {
    /// The statement.
    fn sql() -> &'static str;
    fn is_empty(&self) -> bool;
    /// The arrays, in the statement's order.
    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)>;
}

/// Declares a [`Columns`] type: each column's name, Rust element type,
/// PostgreSQL type and value from a row, in one place, so the statement
/// and its arrays cannot disagree.
macro_rules! columns {
    ($name:ident<$a:lifetime>($row:ident: $row_ty:ty) into $table:literal $conflict:literal {
        $($col:ident: $ty:ty as $pg:literal = $value:expr,)+
    }) => {
        #[derive(Default)]
        struct $name<$a> {
            rows: usize,
            $($col: Vec<$ty>,)+
        }

        impl<$a> $name<$a> {
            fn push(&mut self, $row: $row_ty) {
                self.rows += 1;
                $(self.$col.push($value);)+
            }
        }

        impl Columns for $name<'_> {
            fn sql() -> &'static str {
                static SQL: std::sync::LazyLock<String> =
                    std::sync::LazyLock::new(|| unnest_insert($table, &[$((stringify!($col), $pg)),+], $conflict));
                &SQL
            }

            fn is_empty(&self) -> bool {
                self.rows == 0
            }

            fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
                vec![$(&self.$col),+]
            }
        }
    };
}

/// `INSERT INTO table ("a", "b") SELECT * FROM unnest($1::ta[], $2::tb[]) conflict`.
fn unnest_insert(table: &str, columns: &[(&str, &str)], conflict: &str) -> String {
    let names: Vec<String> = columns.iter().map(|(n, _)| format!("\"{n}\"")).collect();
    let arrays: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, (_, t))| format!("${}::{t}[]", i + 1))
        .collect();
    format!(
        "INSERT INTO {table} ({}) SELECT * FROM unnest({}) {conflict}",
        names.join(", "),
        arrays.join(", ")
    )
}

type Span<'a> = (&'a str, super::ConversationSpan<'a>);

// Item bodies: each once across replicas.
columns! {
    Items<'a>(item: &'a (ItemHash, String)) into "items" "ON CONFLICT DO NOTHING" {
        hash: &'a [u8] as "bytea" = item.0.as_slice(),
        body: Cow<'a, str> as "text" = escape(item.1.as_str()),
    }
}

// The conversations of a batch, each once: created as of its first
// exchange, last seen as of its last. A key another conversation holds
// (committed by another replica meanwhile, or earlier) is not claimed: this
// statement then inserts nothing for it, and the next inserts the
// conversation without it.
columns! {
    KeyedConversations<'a>(span: &'a Span<'a>) into "conversations" "ON CONFLICT DO NOTHING" {
        id: &'a str as "text" = span.0,
        tenant: &'a str as "text" = &span.1.first.tenant,
        explicit_key: Option<Cow<'a, str>> as "text" = escape_opt(span.1.first.explicit_key.as_deref()),
        created_ms: i64 as "bigint" = span.1.first.started_ms,
        last_seen_ms: i64 as "bigint" = span.1.last.started_ms,
        model: Cow<'a, str> as "text" = escape(&span.1.last.model),
    }
}

// Another replica's batch of the same conversation may commit after this
// one: what is newest is kept, whichever commits last.
columns! {
    SeenConversations<'a>(span: &'a Span<'a>) into "conversations"
    "ON CONFLICT (id) DO UPDATE SET
         last_seen_ms = GREATEST(conversations.last_seen_ms, excluded.last_seen_ms),
         model = CASE WHEN excluded.last_seen_ms >= conversations.last_seen_ms
                      THEN excluded.model ELSE conversations.model END,
         preview = COALESCE(conversations.preview, excluded.preview),
         client = COALESCE(excluded.client, conversations.client),
         conversation_header = COALESCE(excluded.conversation_header,
                                        conversations.conversation_header),
         session_id = COALESCE(excluded.session_id, conversations.session_id),
         prompt_cache_key = COALESCE(excluded.prompt_cache_key,
                                     conversations.prompt_cache_key)" {
        id: &'a str as "text" = span.0,
        tenant: &'a str as "text" = &span.1.first.tenant,
        created_ms: i64 as "bigint" = span.1.first.started_ms,
        last_seen_ms: i64 as "bigint" = span.1.last.started_ms,
        model: Cow<'a, str> as "text" = escape(&span.1.last.model),
        preview: Option<Cow<'a, str>> as "text" = escape_opt(span.1.preview),
        client: Option<Cow<'a, str>> as "text" = escape_opt(span.1.client),
        conversation_header: Option<Cow<'a, str>> as "text" = escape_opt(span.1.ids.header.as_deref()),
        session_id: Option<Cow<'a, str>> as "text" = escape_opt(span.1.ids.session.as_deref()),
        prompt_cache_key: Option<Cow<'a, str>> as "text" = escape_opt(span.1.ids.cache_key.as_deref()),
    }
}

columns! {
    Exchanges<'a>(r: &'a ExchangeRecord) into "exchanges" "ON CONFLICT (id) DO NOTHING" {
        id: i64 as "bigint" = r.id,
        conversation_id: &'a str as "text" = &r.conversation,
        tenant: &'a str as "text" = &r.tenant,
        endpoint: &'a str as "text" = r.api.endpoint(),
        model: Cow<'a, str> as "text" = escape(&r.model),
        prefix_exchange: Option<i64> as "bigint" = r.prefix.map(|p| p.exchange),
        prefix_len: i64 as "bigint" = r.prefix.map_or(0, |p| p.len as i64),
        prefix_full: bool as "boolean" = r.prefix.is_some_and(|p| p.full),
        suffix_items: &'a [u8] as "bytea" = r.suffix_items.as_flattened(),
        request_len: i64 as "bigint" = r.request_len as i64,
        params: &'a [u8] as "bytea" = r.params.as_slice(),
        response_items: &'a [u8] as "bytea" = r.response_items.as_flattened(),
        response_id: Option<Cow<'a, str>> as "text" = escape_opt(r.response_id.as_deref()),
        input_tokens: Option<i64> as "bigint" = r.usage.map(|u| u.input_tokens as i64),
        output_tokens: Option<i64> as "bigint" = r.usage.map(|u| u.output_tokens as i64),
        cached_tokens: Option<i64> as "bigint" =
            r.usage.and_then(|u| u.cached_tokens).map(|c| c as i64),
        status: i32 as "integer" = i32::from(r.status),
        streamed: bool as "boolean" = r.streamed,
        partial: bool as "boolean" = r.partial,
        error: Option<Cow<'a, str>> as "text" = escape_opt(r.error.as_deref()),
        started_ms: i64 as "bigint" = r.started_ms,
        latency_ms: f64 as "double precision" = r.latency_ms,
        ttfb_ms: Option<f64> as "double precision" = r.ttfb_ms,
        chain_request: Option<&'a [u8]> as "bytea" = r.chain_request.as_ref().map(|h| h.as_slice()),
        chain_full: Option<&'a [u8]> as "bytea" = r.chain_full.as_ref().map(|h| h.as_slice()),
        compaction_id: Option<&'a str> as "text" = r.compaction.as_deref(),
        context_window: Option<i64> as "bigint" = r.window.map(|w| w.tokens as i64),
        window_source: Option<&'a str> as "text" = r.window.map(|w| w.source.as_str()),
        client: Option<Cow<'a, str>> as "text" = escape_opt(r.client.as_deref()),
        conversation_header: Option<Cow<'a, str>> as "text" = escape_opt(r.client_ids.header.as_deref()),
        session_id: Option<Cow<'a, str>> as "text" = escape_opt(r.client_ids.session.as_deref()),
        prompt_cache_key: Option<Cow<'a, str>> as "text" = escape_opt(r.client_ids.cache_key.as_deref()),
        mode: &'a str as "text" = r.savings.mode.as_str(),
        tokens_saved: i64 as "bigint" = r.savings.tokens_saved as i64,
        tokens_saved_potential: i64 as "bigint" = r.savings.tokens_saved_potential as i64,
        observed_compaction: Option<&'a str> as "text" = r.savings.observed_compaction.as_deref(),
        recall_rounds: i64 as "bigint" = i64::from(r.savings.recall_rounds),
        recall_input_tokens: i64 as "bigint" = r.savings.recall_input_tokens as i64,
        recall_output_tokens: i64 as "bigint" = r.savings.recall_output_tokens as i64,
    }
}

columns! {
    Compactions<'a>(c: &'a Compaction) into "compactions" "ON CONFLICT (id) DO NOTHING" {
        id: &'a str as "text" = &c.id,
        tenant: &'a str as "text" = &c.tenant,
        conversation_id: &'a str as "text" = &c.conversation,
        covered_len: i64 as "bigint" = c.covered_len as i64,
        covered_chain: &'a [u8] as "bytea" = c.covered_chain.as_slice(),
        replacement: String as "text" =
            serde_json::to_string(&c.replacement).unwrap_or_else(|_| "[]".into()),
        rung: &'a str as "text" = c.rung.as_str(),
        reason: Cow<'a, str> as "text" = escape(&c.reason),
        tokens_before: i64 as "bigint" = c.tokens_before as i64,
        tokens_after: i64 as "bigint" = c.tokens_after as i64,
        items_removed: i64 as "bigint" = c.items_removed as i64,
        items_kept: i64 as "bigint" = c.items_kept as i64,
        summary: Option<Cow<'a, str>> as "text" = escape_opt(c.summary.as_deref()),
        facts: Option<String> as "text" =
            c.facts.as_ref().and_then(|f| serde_json::to_string(f).ok()),
        base_id: Option<&'a str> as "text" = c.base.as_deref(),
        summary_calls: i64 as "bigint" = i64::from(c.summary_calls),
        duration_ms: i64 as "bigint" = c.duration_ms as i64,
        created_ms: i64 as "bigint" = c.created_ms,
        summary_tokens: i64 as "bigint" = c.summary_tokens as i64,
        summary_output_tokens: i64 as "bigint" = c.summary_output_tokens as i64,
        tokens_saved: i64 as "bigint" = c.tokens_saved as i64,
        observed: bool as "boolean" = c.observed,
        audit: Option<String> as "text" =
            c.audit.as_ref().and_then(|a| serde_json::to_string(a).ok()),
    }
}

columns! {
    Windows<'a>(w: &'a Told) into "windows"
    "ON CONFLICT (upstream, model) DO UPDATE SET \"window\" = excluded.\"window\",
         source = excluded.source, updated_ms = excluded.updated_ms" {
        upstream: Cow<'a, str> as "text" = escape(&w.upstream),
        model: Cow<'a, str> as "text" = escape(&w.model),
        window: i64 as "bigint" = w.window as i64,
        source: &'a str as "text" = w.source.as_str(),
        updated_ms: i64 as "bigint" = w.updated_ms,
    }
}

/// Column `i` of `row` as a [`Cell`].
fn cell(row: &tokio_postgres::Row, i: usize) -> Result<Cell, StoreError> {
    let ty = row.columns()[i].type_().clone();
    let int = |v: Option<i64>| v.map_or(Cell::Null, Cell::Int);
    Ok(match ty {
        Type::INT8 => int(row.try_get(i)?),
        Type::INT4 => int(row.try_get::<_, Option<i32>>(i)?.map(i64::from)),
        Type::INT2 => int(row.try_get::<_, Option<i16>>(i)?.map(i64::from)),
        Type::BOOL => int(row.try_get::<_, Option<bool>>(i)?.map(i64::from)),
        Type::FLOAT8 => row
            .try_get::<_, Option<f64>>(i)?
            .map_or(Cell::Null, Cell::Real),
        Type::TEXT | Type::VARCHAR | Type::NAME => row
            .try_get::<_, Option<String>>(i)?
            .map_or(Cell::Null, |s| Cell::Text(unescape(s))),
        Type::BYTEA => row
            .try_get::<_, Option<Vec<u8>>>(i)?
            .map_or(Cell::Null, Cell::Blob),
        _ => {
            return Err(StoreError::Column {
                index: i,
                wanted: "type the views read",
            })
        }
    })
}

/// `row` as the plain values the readers written once for both backends
/// take (see [`super::rows`]).
pub(super) fn plain(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
    (0..row.len())
        .map(|i| cell(row, i))
        .collect::<Result<_, _>>()
        .map(Row)
}

/// The point reads of a PostgreSQL store, and the lookups that let every
/// replica find what another recorded.
pub struct PostgresReads {
    pg: Arc<Postgres>,
    /// Names this process in compaction claims.
    owner: String,
    /// The manual compactions this process heard are pending.
    manual: super::postgres_listen::Heard,
}

impl PostgresReads {
    /// Reads over `pg`.
    pub fn new(pg: Arc<Postgres>) -> Self {
        PostgresReads {
            pg,
            owner: crate::ids::new_conversation_id().replacen("conv_", "replica_", 1),
            manual: Default::default(),
        }
    }

    /// The pool the reads use.
    pub(super) fn pg(&self) -> &Arc<Postgres> {
        &self.pg
    }

    /// Runs a read; a failure is logged and reads as nothing found, as
    /// with SQLite.
    fn read<T, F>(&self, what: &'static str, f: impl FnOnce(Pool) -> F) -> Option<T>
    where
        T: Send + 'static,
        F: Future<Output = Result<Option<T>, StoreError>> + Send + 'static,
    {
        self.pg.counted();
        match self.pg.wait(f(self.pg.pool.clone())) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, read = what, "cannot read the store");
                None
            }
        }
    }
}

/// The longest hit of [`super::Reads::exchange_by_chain`] among rows of
/// (id, conversation, request_len, response_len, request matched, full
/// matched, answered whole, tip).
fn best_hit(rows: &[tokio_postgres::Row]) -> Option<ChainHit> {
    rows.iter()
        .flat_map(|r| {
            let (id, conversation): (i64, String) = (r.get(0), r.get(1));
            let (req, resp): (i64, i32) = (r.get(2), r.get(3));
            let (on_request, on_full): (bool, bool) = (r.get(4), r.get(5));
            let (answered, tip): (bool, bool) = (r.get(6), r.get(7));
            let full = on_full.then_some(PrefixRef {
                exchange: id,
                len: req as usize + resp as usize,
                full: true,
            });
            let request = on_request.then_some(PrefixRef {
                exchange: id,
                len: req as usize,
                full: false,
            });
            [full, request]
                .into_iter()
                .flatten()
                .map(move |prefix| ChainHit {
                    conversation: conversation.clone(),
                    prefix,
                    answered,
                    tip,
                })
        })
        // The longest; among equals the newest exchange.
        .max_by_key(|h| (h.prefix.len, h.prefix.exchange))
}

impl super::Reads for PostgresReads {
    fn compaction(&self, id: &str) -> Option<Compaction> {
        let id = id.to_string();
        self.read("compaction", |pool| async move {
            let client = pool.get().await?;
            let sql = format!("SELECT {COMPACTION_COLUMNS} FROM compactions WHERE id = $1");
            let stmt = client.prepare_cached(&sql).await?;
            match client.query_opt(&stmt, &[&id]).await? {
                Some(r) => Ok(Some(super::rows::compaction(&plain(&r)?)?)),
                None => Ok(None),
            }
        })
    }

    fn conversation_of_key(&self, tenant: &str, key: &str) -> Option<String> {
        let (tenant, key) = (tenant.to_string(), escape(key).into_owned());
        self.read("conversation_of_key", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT id FROM conversations WHERE tenant = $1 AND explicit_key = $2",
                )
                .await?;
            Ok(client
                .query_opt(&stmt, &[&tenant, &key])
                .await?
                .map(|r| r.get(0)))
        })
    }

    fn response_history(&self, tenant: &str, response_id: &str) -> Option<Vec<serde_json::Value>> {
        let (tenant, response_id) = (tenant.to_string(), escape(response_id).into_owned());
        self.read("response_history", |pool| async move {
            let client = pool.get().await?;
            response_history(&client, &tenant, &response_id).await
        })
    }

    fn shared(&self) -> bool {
        true
    }

    fn exchange_by_chain(&self, tenant: &str, chains: &[ItemHash]) -> Option<ChainHit> {
        if chains.is_empty() {
            return None;
        }
        let tenant = tenant.to_string();
        let chains: Vec<Vec<u8>> = chains.iter().map(|c| c.to_vec()).collect();
        self.read("exchange_by_chain", |pool| async move {
            let client = pool.get().await?;
            let stmt = client.prepare_cached(BY_CHAIN).await?;
            Ok(best_hit(&client.query(&stmt, &[&tenant, &chains]).await?))
        })
    }

    fn conversation_of_response(&self, tenant: &str, response_id: &str) -> Option<String> {
        let (tenant, response_id) = (tenant.to_string(), escape(response_id).into_owned());
        self.read("conversation_of_response", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT conversation_id FROM exchanges WHERE tenant = $1 AND response_id = $2
                     ORDER BY id DESC LIMIT 1",
                )
                .await?;
            Ok(client
                .query_opt(&stmt, &[&tenant, &response_id])
                .await?
                .map(|r| r.get(0)))
        })
    }

    fn compaction_covering(&self, tenant: &str, chains: &[ItemHash]) -> Option<StoredCompaction> {
        if chains.is_empty() {
            return None;
        }
        let tenant = tenant.to_string();
        let chains: Vec<Vec<u8>> = chains.iter().map(|c| c.to_vec()).collect();
        self.read("compaction_covering", |pool| async move {
            let client = pool.get().await?;
            let stmt = client.prepare_cached(COVERING).await?;
            Ok(client
                .query_opt(&stmt, &[&tenant, &chains])
                .await?
                .map(|r| stored_compaction(&r)))
        })
    }

    fn newest_compaction_ms(&self, tenant: &str, conversation: &str) -> Option<i64> {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        self.read("newest_compaction_ms", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT MAX(created_ms) FROM compactions
                     WHERE tenant = $1 AND conversation_id = $2 AND NOT observed",
                )
                .await?;
            Ok(client
                .query_one(&stmt, &[&tenant, &conversation])
                .await?
                .get(0))
        })
    }

    fn claim(&self, tenant: &str, conversation: &str, _for_ms: i64) -> bool {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        let owner = self.owner.clone();
        // The lapse is the deployment's (`store.claim_lapse_secs`): every
        // replica of one database should be given the same.
        let for_ms = self.pg.claim_lapse.as_millis() as i64;
        // An expired claim (its replica died, or overran) is taken over.
        let claimed = self.read("claim", |pool| async move {
            let client = pool.get().await?;
            let now = crate::ids::now_ms();
            let stmt = client
                .prepare_cached(
                    "INSERT INTO compaction_claims (tenant, conversation_id, owner, expires_ms)
                     VALUES ($1, $2, $3, $4)
                     ON CONFLICT (tenant, conversation_id) DO UPDATE
                         SET owner = excluded.owner, expires_ms = excluded.expires_ms
                         WHERE compaction_claims.expires_ms < $5
                     RETURNING owner",
                )
                .await?;
            let row = client
                .query_opt(
                    &stmt,
                    &[&tenant, &conversation, &owner, &(now + for_ms), &now],
                )
                .await?;
            Ok(Some(row.is_some()))
        });
        claimed.unwrap_or(false)
    }

    fn release(&self, tenant: &str, conversation: &str) {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        let owner = self.owner.clone();
        self.read("release", |pool| async move {
            let client = pool.get().await?;
            client
                .execute(
                    "DELETE FROM compaction_claims
                     WHERE tenant = $1 AND conversation_id = $2 AND owner = $3",
                    &[&tenant, &conversation, &owner],
                )
                .await?;
            Ok(Some(()))
        });
    }

    fn request_manual(&self, conversation: &str) -> Result<bool, StoreError> {
        let owned = conversation.to_string();
        let pool = self.pg.pool.clone();
        let newly = self.pg.wait(async move {
            let mut client = pool.get().await?;
            super::postgres_listen::request(&mut client, &owned).await
        })?;
        // Committed: if another replica takes it first, the take here finds
        // no row and forgets it.
        self.manual.hear(conversation);
        Ok(newly)
    }

    fn manual_pending(&self, conversation: &str) -> Result<bool, StoreError> {
        let conversation = conversation.to_string();
        let pool = self.pg.pool.clone();
        self.pg.wait(async move {
            let client = pool.get().await?;
            super::postgres_listen::pending(&client, &conversation).await
        })
    }

    fn manual_heard(&self, conversation: &str) -> bool {
        self.manual.contains(conversation)
    }

    fn take_manual(&self, tenant: &str, conversation: &str) -> bool {
        let (tenant, owned) = (tenant.to_string(), conversation.to_string());
        let taken = self.read("take_manual", |pool| async move {
            let client = pool.get().await?;
            super::postgres_listen::take(&client, &tenant, &owned)
                .await
                .map(Some)
        });
        match taken {
            // Taken here, or by another replica first: nothing to hear of.
            Some(taken) => {
                self.manual.forget(conversation);
                taken
            }
            // The database did not answer: the next request tries again.
            None => false,
        }
    }

    fn on_forgotten(&self, f: Box<dyn Fn(&str) + Send + Sync>) {
        self.manual.on_forget(f);
    }

    fn look_up(&self, tenant: &str, chains: &[ItemHash], ask: LookUp) -> ReadFuture<Found> {
        self.pg.look_up(tenant, chains, ask)
    }

    fn on_compacted(&self, f: Box<dyn Fn(StoredCompaction) + Send + Sync>) {
        self.manual.on_compacted(Box::new(move |p| {
            Postgres::announced(p).into_iter().for_each(&f)
        }));
    }

    fn hearing(&self) -> Option<u64> {
        self.manual.hearing()
    }

    fn record_attempt(&self, tenant: &str, conversation: &str, attempt: &AttemptRecord) {
        let (tenant, conversation, a) = (
            tenant.to_string(),
            conversation.to_string(),
            attempt.clone(),
        );
        self.read("record_attempt", |pool| async move {
            let client = pool.get().await?;
            // The newest stays, whichever replica commits last.
            let stmt = client
                .prepare_cached(
                    "INSERT INTO compaction_attempts
                         (conversation_id, tenant, at_ms, result, tokens_before, tokens_after,
                          error)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)
                     ON CONFLICT (conversation_id) DO UPDATE
                         SET at_ms = excluded.at_ms, result = excluded.result,
                             tokens_before = excluded.tokens_before,
                             tokens_after = excluded.tokens_after, error = excluded.error
                         WHERE compaction_attempts.at_ms <= excluded.at_ms",
                )
                .await?;
            let tokens = |t: Option<u64>| t.map(|t| t as i64);
            client
                .execute(
                    &stmt,
                    &[
                        &conversation,
                        &tenant,
                        &a.at_ms,
                        &a.result,
                        &tokens(a.tokens_before),
                        &tokens(a.tokens_after),
                        &escape_opt(a.error.as_deref()),
                    ],
                )
                .await?;
            Ok(Some(()))
        });
    }

    fn latest_attempt(&self, tenant: &str, conversation: &str) -> Option<AttemptRecord> {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        self.read("latest_attempt", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT at_ms, result, tokens_before, tokens_after, error
                     FROM compaction_attempts WHERE tenant = $1 AND conversation_id = $2",
                )
                .await?;
            let tokens = |t: Option<i64>| t.map(|t| t.max(0) as u64);
            Ok(client
                .query_opt(&stmt, &[&tenant, &conversation])
                .await?
                .map(|r| AttemptRecord {
                    at_ms: r.get(0),
                    result: r.get(1),
                    tokens_before: tokens(r.get(2)),
                    tokens_after: tokens(r.get(3)),
                    error: unescape_opt(r.get(4)),
                }))
        })
    }
}

/// [`super::rows::response_history`] over PostgreSQL: the prefix
/// references followed back in one recursive query, the bodies read in one.
async fn response_history(
    client: &tokio_postgres::Client,
    tenant: &str,
    response_id: &str,
) -> Result<Option<Vec<serde_json::Value>>, StoreError> {
    let Some(found) = client
        .query_opt(
            "SELECT id FROM exchanges
             WHERE tenant = $1 AND response_id = $2 AND status BETWEEN 200 AND 299
                   AND NOT partial
             ORDER BY id DESC LIMIT 1",
            &[&tenant, &response_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let id: i64 = found.get(0);
    let rows = client
        .query(
            "WITH RECURSIVE chain(id, prefix_exchange, prefix_len, prefix_full, suffix_items,
                                  response_items, depth) AS (
                 SELECT id, prefix_exchange, prefix_len, prefix_full, suffix_items,
                        response_items, 0
                 FROM exchanges WHERE id = $1
                 UNION ALL
                 SELECT e.id, e.prefix_exchange, e.prefix_len, e.prefix_full, e.suffix_items,
                        e.response_items, c.depth + 1
                 FROM exchanges e JOIN chain c ON e.id = c.prefix_exchange
             )
             SELECT prefix_exchange, prefix_len, prefix_full, suffix_items, response_items
             FROM chain ORDER BY depth DESC",
            &[&id],
        )
        .await?;
    let links: Vec<super::sqlite::Link> = rows
        .iter()
        .map(|r| {
            (
                r.get::<_, Option<i64>>(0),
                r.get::<_, i64>(1) as usize,
                r.get(2),
                super::sqlite::unpack_hashes(r.get(3)),
                super::sqlite::unpack_hashes(r.get(4)),
            )
        })
        .collect();
    let Some(last) = links.last() else {
        return Ok(None);
    };
    let response = last.4.clone();
    let mut hashes = super::sqlite::rebuild_items(links);
    hashes.extend(response);
    let wanted: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
    let rows = client
        .query(
            "SELECT hash, body FROM items WHERE hash = ANY($1)",
            &[&wanted],
        )
        .await?;
    let bodies: foldhash::HashMap<Vec<u8>, String> = rows
        .iter()
        .map(|r| (r.get(0), unescape(r.get(1))))
        .collect();
    let mut items = Vec::with_capacity(hashes.len());
    for h in &hashes {
        let Some(body) = bodies.get(h.as_slice()) else {
            return Ok(None);
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
            return Ok(None);
        };
        if !crate::wire::responses::is_instructions_item(&v) {
            items.push(v);
        }
    }
    Ok(Some(items))
}

impl PostgresReads {
    /// Makes this process hear of manual compactions whichever replica was
    /// asked (see [`super::postgres_listen`]): returns once the pending ones
    /// are read, or the database could not be reached for them in time
    /// (then it keeps trying in the background).
    pub fn listening(self, opts: &Options) -> Result<Self, StoreError> {
        let started = self.manual.listen(&self.pg.handle, opts.pg_config()?);
        // Read before the first request is served, so that a compaction
        // asked for while no replica was up applies to it.
        let _ = self.pg.wait(async move {
            let _ = started.await;
            Ok(())
        });
        Ok(self)
    }
}

/// The request path's reads of what other replicas recorded, awaited
/// rather than waited for, and what replicas announce: the longest
/// recorded prefix of a request and the compaction covering the most of
/// it, asked together in one round trip (the two statements are sent
/// before either answer is awaited) on the backend's runtime, so that no
/// request's worker blocks; and every compaction stored, announced on
/// [`super::postgres_listen::COMPACTED`] by a trigger, so that a replica
/// that hears them all asks for a conversation's compactions only once.
impl Postgres {
    /// Round trips the request path's reads of the database made
    /// (`compactor_store_reads_total`): a [`super::Reads::look_up`] one,
    /// whatever it asks; each other read of [`PostgresReads`] one.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    fn counted(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// [`super::Reads::look_up`], run on the backend's runtime.
    fn look_up(&self, tenant: &str, chains: &[ItemHash], ask: LookUp) -> ReadFuture<Found> {
        let from = |at: Option<usize>| {
            at.filter(|&at| at < chains.len())
                .map(|at| chains[at..].iter().map(|c| c.to_vec()).collect::<Vec<_>>())
        };
        let (prefix, covering) = (from(ask.prefix_from), from(ask.covering_from));
        let (body_of, covering) = match (ask.body_of, covering) {
            (None, None) => (None, None),
            (body_of, covering) => (body_of, Some(covering.unwrap_or_default())),
        };
        if prefix.is_none() && covering.is_none() {
            return Box::pin(std::future::ready(Found::default()));
        }
        self.counted();
        let (pool, timeout, tenant) = (self.pool.clone(), self.timeout, tenant.to_string());
        let task = self.handle.spawn(async move {
            let read = look_up(&pool, &tenant, prefix, covering, body_of);
            tokio::time::timeout(timeout, read)
                .await
                .unwrap_or(Err(StoreError::Timeout))
        });
        Box::pin(async move {
            match task.await {
                Ok(Ok(found)) => found,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, read = "look_up", "cannot read the store");
                    Found::default()
                }
                Err(e) => {
                    tracing::warn!(error = %e, read = "look_up", "cannot read the store");
                    Found::default()
                }
            }
        })
    }

    /// The compaction a [`super::postgres_listen::COMPACTED`] announcement
    /// tells of: `tenant id covered_len covered_chain created_ms
    /// conversation`, the chain in hex.
    fn announced(payload: &str) -> Option<StoredCompaction> {
        let mut parts = payload.splitn(6, ' ');
        let mut next = || parts.next().filter(|p| !p.is_empty());
        let (tenant, id) = (next()?.to_string(), next()?.to_string());
        let covered_len = next()?.parse().ok()?;
        let covered_chain = *blake3::Hash::from_hex(next()?).ok()?.as_bytes();
        let created_ms = next()?.parse().ok()?;
        Some(StoredCompaction {
            id,
            tenant,
            conversation: next()?.to_string(),
            covered_len,
            covered_chain,
            created_ms,
            observed: false,
        })
    }
}

/// The statement of [`super::Reads::exchange_by_chain`]: rows for
/// [`best_hit`].
const BY_CHAIN: &str = "SELECT id, conversation_id, request_len, length(response_items) / 32,
        COALESCE(chain_request = ANY($2), FALSE),
        COALESCE(chain_full = ANY($2), FALSE),
        chain_full IS NOT NULL,
        NOT EXISTS (SELECT 1 FROM exchanges later WHERE later.prefix_exchange = e.id)
 FROM exchanges e
 WHERE tenant = $1 AND (chain_request = ANY($2) OR chain_full = ANY($2))
 ORDER BY id DESC LIMIT 64";

/// The statement of [`super::Reads::look_up`]'s compaction: the one
/// covering the most among chains `$2`, or else compaction `$3`, whole.
fn covering_whole() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "SELECT {COMPACTION_COLUMNS} FROM compactions
             WHERE tenant = $1 AND (covered_chain = ANY($2) AND NOT observed OR id = $3)
             ORDER BY covered_len DESC, created_ms DESC LIMIT 1"
        )
    })
}

/// The statement of [`super::Reads::compaction_covering`]: a row for
/// [`stored_compaction`].
const COVERING: &str = "SELECT id, tenant, conversation_id, covered_len, covered_chain, created_ms,
        observed
 FROM compactions
 WHERE tenant = $1 AND covered_chain = ANY($2) AND NOT observed
 ORDER BY covered_len DESC, created_ms DESC LIMIT 1";

/// The lookups of [`Postgres::look_up`] that are asked, sent together.
async fn look_up(
    pool: &Pool,
    tenant: &str,
    prefix: Option<Vec<Vec<u8>>>,
    covering: Option<Vec<Vec<u8>>>,
    body_of: Option<String>,
) -> Result<Found, StoreError> {
    let client = pool.get().await?;
    let prepare = |sql: &'static str, asked: bool| {
        let client = &client;
        async move {
            match asked {
                true => client.prepare_cached(sql).await.map(Some),
                false => Ok(None),
            }
        }
    };
    // Prepared once per connection (together, the first time).
    let (by_chain, covers) = tokio::join!(
        prepare(BY_CHAIN, prefix.is_some()),
        prepare(covering_whole(), covering.is_some())
    );
    let (by_chain, covers) = (by_chain?, covers?);
    let rows = async {
        match (&by_chain, &prefix) {
            (Some(stmt), Some(chains)) => client.query(stmt, &[&tenant, chains]).await,
            _ => Ok(Vec::new()),
        }
    };
    let row = async {
        match (&covers, &covering) {
            (Some(stmt), Some(chains)) => {
                client.query_opt(stmt, &[&tenant, chains, &body_of]).await
            }
            _ => Ok(None),
        }
    };
    // Both are sent on the first poll, before either answer is awaited.
    let (rows, row) = tokio::join!(rows, row);
    let compaction = match row? {
        Some(r) => Some(super::rows::compaction(&plain(&r)?)?),
        None => None,
    };
    Ok(Found {
        chain: best_hit(&rows?),
        compaction,
        answered: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_announcement_reads_as_the_compaction_it_tells_of() {
        let chain = [7u8; 32];
        let payload = format!(
            "0123abcd cmp_1 12 {} 1700000000000 conv_x",
            blake3::Hash::from_bytes(chain).to_hex()
        );
        let c = Postgres::announced(&payload).expect("announced");
        assert_eq!(
            (c.tenant.as_str(), c.id.as_str(), c.conversation.as_str()),
            ("0123abcd", "cmp_1", "conv_x")
        );
        assert_eq!((c.covered_len, c.covered_chain), (12, chain));
        assert_eq!((c.created_ms, c.observed), (1_700_000_000_000, false));
        // Anything else is not one.
        for bad in [
            "",
            "t cmp_1 12",
            "t cmp_1 x 00 1 conv",
            &payload.replace(" 12 ", " -1 "),
        ] {
            assert!(Postgres::announced(bad).is_none(), "{bad}");
        }
    }
}
