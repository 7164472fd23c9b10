//! A look at an SQLite store from outside the proxy (`compactor doctor`):
//! whether it can be opened and written as a running proxy would, without
//! changing it.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use rusqlite::{Connection, OpenFlags};

/// The number of conversations the store at `path` holds, once it has been
/// opened for writing and its write lock taken and given back (waiting up
/// to `timeout` for a running proxy's commit); otherwise why not.
pub fn writable(path: &Path, timeout: Duration) -> anyhow::Result<u64> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .context("cannot open it for writing")?;
    conn.busy_timeout(timeout)?;
    let conversations: u64 = conn
        .query_row("SELECT count(*) FROM conversations", [], |r| r.get(0))
        .context("not a compactor store")?;
    // BEGIN IMMEDIATE takes the write lock: what fails on a read-only file,
    // disk or directory.
    conn.execute_batch("BEGIN IMMEDIATE; ROLLBACK;")
        .context("cannot be written")?;
    Ok(conversations)
}
