//! The embedded SQLite backend (WAL). Nothing to install; one file.
//!
//! The writer's connection and the point reads are in `backend`, the views'
//! connections in `queries`, the doctor's look from outside in `check`.

mod backend;
mod check;
mod queries;

pub use backend::{SqliteBackend, SqliteReads};
pub use check::writable;
pub use queries::{import_orphaned, open_for_maintenance, open_read_only};
