//! The PostgreSQL backend: records shared by every replica given the same
//! database, so that a conversation whose requests land on several
//! processes stays one conversation.
//!
//! The store's interface is blocking (a writer thread, point reads from
//! any thread), the driver is async: the backend runs its own small tokio
//! runtime, and every call is a future run there and waited for. The
//! writer thread commits each batch in one transaction: exchanges that end
//! together share one commit (the group commit), and an exchange's answer
//! is released only once its commit is done, unless a local journal
//! (`store.local_journal`) holds it first (see `Store::start_shared`).
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
//! (`text`), since PostgreSQL's refuses U+0000; the
//! exchanges of a commit that timed out are written again as withheld with
//! the next batch, whatever became of that commit.
//!
//! The pool, its runtime and the database's health are in `pool`; the
//! schema's migrations in `schema`, the writer's side in `backend`, the
//! reads in `reads`, the look-ups by chain in `lookup` with the branch
//! probes in `probes`, rows as read in `rows`; the views'
//! connection in `queries`, the `LISTEN` connection in `listen`, text as
//! stored in `text`.

mod backend;
mod listen;
mod lookup;
mod pool;
mod probes;
mod queries;
mod reads;
mod rows;
mod schema;
mod text;

pub use backend::{PostgresBackend, WITHHELD};
pub use pool::{Options, Postgres, SchemaStatus};
pub use queries::{connect, PgSql};
pub use reads::PostgresReads;
