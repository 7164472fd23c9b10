//! The store's error: what a backend, the writer thread or a read reports.

use std::sync::Arc;

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
