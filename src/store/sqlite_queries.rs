//! The SQLite backend's [`super::Queries`]: each a read-only connection of
//! its own, never the writer thread's (WAL lets them read while the proxy
//! writes); deletions on a maintenance connection beside the writer.

use super::query::open_read_only;
use super::retention::open_for_maintenance;
use super::sql::Sql;
use super::StoreError;

impl super::Queries for super::sqlite::SqliteReads {
    fn views(&self) -> Result<Box<dyn Sql>, StoreError> {
        Ok(Box::new(open_read_only(self.path())?))
    }

    fn maintenance(&self) -> Result<Box<dyn Sql>, StoreError> {
        Ok(Box::new(open_for_maintenance(self.path())?))
    }
}
