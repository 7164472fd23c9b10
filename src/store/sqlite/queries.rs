//! The SQLite backend's [`Queries`]: each a read-only connection of
//! its own, never the writer thread's (WAL lets them read while the proxy
//! writes); deletions on a maintenance connection beside the writer.

use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use super::backend::{SqliteBackend, SqliteReads};
use crate::store::error::StoreError;
use crate::store::journal;
use crate::store::sql::Sql;
use crate::store::traits::{Backend, Queries};

impl Queries for SqliteReads {
    fn views(&self) -> Result<Box<dyn Sql>, StoreError> {
        Ok(Box::new(open_read_only(self.path())?))
    }

    fn maintenance(&self) -> Result<Box<dyn Sql>, StoreError> {
        Ok(Box::new(open_for_maintenance(self.path())?))
    }
}

/// Opens the database read-only (it must exist). Safe while the proxy runs.
/// When no process serves the store, exchanges its journal still holds (a
/// server was killed) are imported first.
pub fn open_read_only(path: &Path) -> Result<Connection, StoreError> {
    if !path.exists() {
        return Err(StoreError::Io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no store at {}", path.display()),
        )));
    }
    import_orphaned(path)?;
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    Ok(conn)
}

/// A writable connection to the store at `path` for maintenance, beside a
/// proxy that may be writing (it waits for the lock as the proxy does).
pub fn open_for_maintenance(path: &Path) -> Result<Connection, StoreError> {
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

/// What the journal of the store at `path` holds, imported into the file
/// if no process serves the store (see [`journal::import_orphaned`]), so
/// that a reader in another process sees the exchanges of a killed server.
/// Returns how many records were imported.
pub fn import_orphaned(path: &Path) -> Result<usize, StoreError> {
    journal::import_orphaned(path, |db, batch| SqliteBackend::open(db)?.write(batch))
}
