//! The store's one door: the only place that chooses the backend, the
//! SQLite file or the PostgreSQL database the replicas share, as the config
//! says. What it hands out are the store's handle and traits, so nothing
//! outside the store names a backend.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use super::error::StoreError;
use super::journal::Journal;
use super::postgres::{self, Postgres, PostgresBackend, PostgresReads, SchemaStatus};
use super::query::QueryError;
use super::records::{Limits, Snapshot};
use super::sql::Sql;
use super::sqlite::{
    import_orphaned, open_for_maintenance, open_read_only, SqliteBackend, SqliteReads,
};
use super::traits::Reads;
use super::writer::{SharedDatabase, Store};
use crate::config::Config;

/// A store opened for a proxy to serve from.
pub struct Opened {
    /// The handle and its writer thread.
    pub store: Arc<Store>,
    /// What was loaded at start-up.
    pub snapshot: Snapshot,
    /// The point reads (compaction bodies, explicit keys,
    /// `previous_response_id` histories).
    pub reads: Arc<dyn Reads>,
    /// The database other replicas write too, when the records are in one
    /// (for the readiness probe and the gauges).
    pub shared: Option<Arc<dyn SharedDatabase>>,
}

/// Opens the store `config` names, loading what the indexes start from
/// within `limits`: the PostgreSQL database migrated to this build's schema
/// (with its local journal, if one is configured), or the SQLite file with
/// its journal's leftovers imported.
pub fn open(config: &Config, limits: Limits) -> anyhow::Result<Opened> {
    if !config.store.is_postgres() {
        let path = config.store_path();
        // The store's lock first: a second server opening the file for
        // writing (its schema, its WAL) while the first serves it can
        // leave the first a malformed database.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot open store {}: {e}", path.display()))?;
        }
        let journal = Journal::open(&path)
            .map_err(|e| anyhow::anyhow!("cannot open the journal of {}: {e}", path.display()))?;
        let backend = SqliteBackend::open_writer(&path)
            .map_err(|e| anyhow::anyhow!("cannot open store {}: {e}", path.display()))?;
        let (store, snapshot) = Store::start(Box::new(backend), Some(journal), limits)?;
        return Ok(Opened {
            store,
            snapshot,
            reads: Arc::new(SqliteReads::new(&path)),
            shared: None,
        });
    }
    let shown = config.store.shown_url();
    let opts = postgres::Options::from_config(&config.store);
    let pg = Postgres::open(&opts)
        .map_err(|e| anyhow::anyhow!("cannot open the database {shown}: {e}"))?;
    // A local journal: answers go before their commit.
    let journal = if config.store.local_journal {
        let path = config.postgres_journal_path();
        Some(
            Journal::open(&path)
                .map_err(|e| anyhow::anyhow!("cannot open the journal {}: {e}", path.display()))?,
        )
    } else {
        None
    };
    let (store, snapshot) = Store::start_shared(
        Box::new(PostgresBackend::new(pg.clone())),
        pg.clone(),
        journal,
        limits,
        Duration::from_millis(config.store.commit_delay_ms),
    )
    .map_err(|e| anyhow::anyhow!("cannot load the database {shown}: {e}"))?;
    let reads = PostgresReads::new(pg.clone()).listening(&opts)?;
    Ok(Opened {
        store,
        snapshot,
        reads: Arc::new(reads),
        shared: Some(pg),
    })
}

/// A connection for the views (list, show, export, savings): the SQLite
/// file read-only, or one pooled connection to the PostgreSQL store (whose
/// schema must be current).
pub fn views(config: &Config) -> anyhow::Result<Box<dyn Sql>> {
    if config.store.is_postgres() {
        return shared_views(config);
    }
    let path = config.store_path();
    open_read_only(&path)
        .map(|c| Box::new(c) as Box<dyn Sql>)
        .with_context(|| format!("cannot open the store {}", path.display()))
}

/// A connection for deleting from the store while no proxy serves its
/// file: the SQLite file, once what its journal held is imported, or one
/// pooled connection to the PostgreSQL store (deleted there, every replica
/// told to forget what went).
pub fn maintenance(config: &Config) -> anyhow::Result<Box<dyn Sql>> {
    if config.store.is_postgres() {
        return shared_views(config);
    }
    let path = config.store_path();
    import_orphaned(&path)
        .and_then(|_| open_for_maintenance(&path))
        .map(|c| Box::new(c) as Box<dyn Sql>)
        .map_err(|e| QueryError::from(e).into())
}

/// One pooled connection to the PostgreSQL store: its views and its
/// deletions are the same connection.
fn shared_views(config: &Config) -> anyhow::Result<Box<dyn Sql>> {
    let opts = postgres::Options::from_config(&config.store);
    postgres::connect(&opts)
        .map(|c| Box::new(c) as Box<dyn Sql>)
        .context("cannot read the PostgreSQL store")
}

/// Where the shared database's schema stands, connecting with the
/// configured credentials and changing nothing. Blocking: the pool has a
/// runtime of its own, which may not be built or dropped on an async
/// thread. An SQLite store has no schema to report (it brings its file up
/// to date as it opens it).
pub fn schema_status(config: &Config) -> Result<SchemaStatus, StoreError> {
    if !config.store.is_postgres() {
        return Err(StoreError::Unsupported {
            backend: "sqlite",
            what: "report its schema",
        });
    }
    let opts = postgres::Options::from_config(&config.store);
    Postgres::new(&opts).and_then(|pg| pg.status())
}
