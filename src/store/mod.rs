//! Records: conversations, exchanges and content-addressed items.
//!
//! One interface ([`Backend`], [`Reads`], [`Queries`]) with an embedded
//! SQLite implementation and a [`postgres`] one that several replicas share.
//! All writes go through one writer thread that commits in batches, so the
//! async request path never blocks on the database. With SQLite an exchange
//! is appended to the [`journal`] (one write, shared by the exchanges that
//! end in the same turn of the runtime) just before its answer's last bytes
//! are released, which is what makes an acknowledged exchange survive a
//! crash; the writer imports journaled exchanges within `IMPORT_DELAY`. With
//! PostgreSQL there is no journal: the exchange's commit comes first.
//!
//! What is recorded is in `records`, the backends' traits in `traits`, the
//! handle and its writer thread in `writer`; the store error and what the
//! backends share in writing a batch are here.

pub mod journal;
pub mod postgres;
pub mod postgres_listen;
pub mod postgres_queries;
pub mod postgres_text;
pub mod query;
mod records;
pub mod retention;
pub mod rows;
pub mod savings;
mod traits;
mod writer;

/// Characters of the tenant hash shown (enough to tell tenants apart).
pub const TENANT_PREFIX: usize = 12;
pub mod sql;
pub mod sqlite;
pub mod sqlite_check;
mod sqlite_queries;

use std::sync::Arc;

pub use journal::Journal;
pub use records::{
    bounded_text, AttemptRecord, ChainHit, ClientIds, ExchangeRecord, ExchangeSavings,
    IndexedExchange, LeftOut, Limits, PrefixRef, Record, RecordedWindow, Snapshot,
    StoredCompaction, MAX_CLIENT_CHARS, MAX_CLIENT_ID_CHARS, MAX_PREVIEW_CHARS,
};
pub use traits::{Backend, Found, LookUp, Queries, ReadFuture, Reads};
pub use writer::{CommitObserver, SharedDatabase, Store, KNOWN_ITEMS};

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database reported an error.
    #[error("database: {0}")]
    Db(#[from] rusqlite::Error),
    /// PostgreSQL reported an error (or could not be reached).
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// No PostgreSQL connection could be had.
    #[error("postgres pool: {0}")]
    Pool(String),
    /// A PostgreSQL call took longer than its bound.
    #[error("postgres: no answer in time")]
    Timeout,
    /// The database is stalled or down: requests are refused until a
    /// commit succeeds again.
    #[error("postgres: stalled: {0}")]
    Stalled(String),
    /// Filesystem trouble (creating the directory…).
    #[error("store io: {0}")]
    Io(#[from] std::io::Error),
    /// This store does not answer this read yet.
    #[error("the {backend} store cannot {what} yet")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// What was asked of it.
        what: &'static str,
    },
    /// A column held another type than the reader expected.
    #[error("column {index} is not a {wanted}")]
    Column {
        /// The column's index in the row.
        index: usize,
        /// The type the reader wanted.
        wanted: &'static str,
    },
    /// An exchange another one refers to is not in the store.
    #[error("exchange {0} is not in the store")]
    MissingExchange(i64),
    /// The PostgreSQL schema is older than this build's.
    #[error("the database's schema is at version {applied}, this build's at {latest}: start `compactor serve` once to bring it up to date")]
    Schema {
        /// The newest migration applied.
        applied: i32,
        /// The newest this build knows.
        latest: i32,
    },
    /// The writer thread is gone.
    #[error("store writer stopped")]
    Closed,
    /// The commit of a batch failed: the backend's error, shared by every
    /// record of the batch that waited for it.
    #[error("commit failed: {0}")]
    Commit(#[source] Arc<StoreError>),
}

impl StoreError {
    /// Whether the database refused a write for a value a record holds (a
    /// data exception, a constraint, a value past a limit such as an index
    /// row's size), rather than because it could not be reached or is in
    /// trouble: another record of the same batch would have been taken.
    pub fn is_refusal(&self) -> bool {
        match self {
            StoreError::Postgres(e) => e
                .code()
                .is_some_and(|c| matches!(c.code().get(..2), Some("22" | "23" | "54"))),
            StoreError::Commit(e) => e.is_refusal(),
            _ => false,
        }
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => StoreError::Postgres(e),
            other => StoreError::Pool(other.to_string()),
        }
    }
}

/// A conversation's part of a batch: it is created as of its first
/// exchange, last seen (with its model, client and ids) as of its last; its
/// preview is the first one given.
struct ConversationSpan<'a> {
    first: &'a ExchangeRecord,
    last: &'a ExchangeRecord,
    preview: Option<&'a str>,
    client: Option<&'a str>,
    ids: ClientIds,
}

/// The conversations of a batch's exchanges, each once, in the order they
/// first appear (every backend writes them before the exchanges).
fn conversation_spans(batch: &[Record]) -> Vec<(&str, ConversationSpan<'_>)> {
    let mut order: Vec<&str> = Vec::new();
    let mut spans: foldhash::HashMap<&str, ConversationSpan<'_>> = Default::default();
    for rec in batch {
        if let Record::Exchange(e) = rec {
            let span = spans.entry(&e.conversation).or_insert_with(|| {
                order.push(&e.conversation);
                ConversationSpan {
                    first: e,
                    last: e,
                    preview: None,
                    client: None,
                    ids: ClientIds::default(),
                }
            });
            span.last = e;
            span.preview = span.preview.or(e.preview.as_deref());
            span.client = e.client.as_deref().or(span.client);
            let ids = &e.client_ids;
            for (mine, theirs) in [
                (&mut span.ids.header, &ids.header),
                (&mut span.ids.session, &ids.session),
                (&mut span.ids.cache_key, &ids.cache_key),
            ] {
                if theirs.is_some() {
                    mine.clone_from(theirs);
                }
            }
        }
    }
    order
        .into_iter()
        .filter_map(|c| spans.remove(c).map(|span| (c, span)))
        .collect()
}
