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
//! The one door is [`open`]: the only place that chooses the backend from
//! the config; everything outside the store holds its traits. What is
//! recorded is in `records`, the backends' traits in `traits`, the handle
//! and its writer thread in `writer`, the store error in `error`, what the
//! backends share in writing a batch in `batch` and in reading rows back in
//! `rows`; each backend in a folder of its own (`sqlite`, `postgres`).

mod batch;
mod error;
pub mod journal;
mod open;
pub mod postgres;
pub mod query;
mod records;
pub mod retention;
pub mod rows;
pub mod savings;
pub mod sql;
pub mod sqlite;
mod traits;
mod writer;

pub use error::StoreError;
pub use journal::Journal;
pub use open::{maintenance, open, schema_status, views, Opened};
pub use postgres::SchemaStatus;
pub use records::{
    bounded_text, AttemptRecord, ChainHit, ClientIds, ExchangeRecord, ExchangeSavings,
    IndexedExchange, LeftOut, Limits, PrefixRef, Record, RecordedWindow, Snapshot,
    StoredCompaction, KNOWN_ITEMS, MAX_CLIENT_CHARS, MAX_CLIENT_ID_CHARS, MAX_PREVIEW_CHARS,
    TENANT_PREFIX,
};
pub use sqlite::writable;
pub use traits::{Backend, Found, LookUp, Queries, ReadFuture, Reads};
pub use writer::{CommitObserver, SharedDatabase, Store};
