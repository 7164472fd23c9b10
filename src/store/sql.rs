//! The views' SQL, written once for both backends: a statement with `?N`
//! placeholders, its parameters and its rows as plain values. The views
//! (`query`, `savings`, `retention`) read and delete through [`Sql`]; SQLite
//! and PostgreSQL each implement it over a connection of their own.
//!
//! The two schemas have the same tables and columns; what differs is
//! spelled by [`Dialect`] (SQLite's `rowid`, PostgreSQL's booleans). Rows
//! are copied out as [`Cell`]s: the views read at most a conversation's
//! exchanges at a time, so the copy costs nothing next to the round trip.

use super::error::StoreError;

/// Which database a [`Sql`] speaks to, where the statements must differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// The embedded store.
    Sqlite,
    /// The shared store.
    Postgres,
}

/// A statement parameter.
#[derive(Debug, Clone, Copy)]
pub enum Param<'a> {
    /// SQL `NULL`.
    Null,
    /// An integer (also a boolean, as 0 or 1).
    Int(i64),
    /// Text.
    Text(&'a str),
    /// Bytes.
    Blob(&'a [u8]),
}

impl<'a> From<&'a str> for Param<'a> {
    fn from(s: &'a str) -> Self {
        Param::Text(s)
    }
}

impl<'a> From<&'a String> for Param<'a> {
    fn from(s: &'a String) -> Self {
        Param::Text(s)
    }
}

impl From<i64> for Param<'_> {
    fn from(v: i64) -> Self {
        Param::Int(v)
    }
}

impl<'a> From<&'a [u8]> for Param<'a> {
    fn from(b: &'a [u8]) -> Self {
        Param::Blob(b)
    }
}

impl<'a, T: Into<Param<'a>>> From<Option<T>> for Param<'a> {
    fn from(v: Option<T>) -> Self {
        v.map_or(Param::Null, Into::into)
    }
}

/// One value of a row.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// SQL `NULL`.
    Null,
    /// An integer or a boolean.
    Int(i64),
    /// A floating-point number.
    Real(f64),
    /// Text.
    Text(String),
    /// Bytes.
    Blob(Vec<u8>),
}

/// A row of a result.
#[derive(Debug, Clone, PartialEq)]
pub struct Row(pub Vec<Cell>);

impl Row {
    /// Column `i` as a `T`.
    pub fn get<T: FromCell>(&self, i: usize) -> Result<T, StoreError> {
        let cell = self.0.get(i).unwrap_or(&Cell::Null);
        T::from_cell(cell).ok_or(StoreError::Column {
            index: i,
            wanted: std::any::type_name::<T>(),
        })
    }

    /// Column `i` as a count: an integer, negatives as 0, `NULL` as 0.
    pub fn count(&self, i: usize) -> Result<u64, StoreError> {
        Ok(self.get::<Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
    }
}

/// A type a [`Cell`] converts to.
pub trait FromCell: Sized {
    /// The value, or `None` when the cell holds another type.
    fn from_cell(cell: &Cell) -> Option<Self>;
}

impl FromCell for i64 {
    fn from_cell(cell: &Cell) -> Option<Self> {
        match cell {
            Cell::Int(v) => Some(*v),
            _ => None,
        }
    }
}

impl FromCell for u16 {
    fn from_cell(cell: &Cell) -> Option<Self> {
        i64::from_cell(cell).and_then(|v| u16::try_from(v).ok())
    }
}

impl FromCell for u32 {
    fn from_cell(cell: &Cell) -> Option<Self> {
        i64::from_cell(cell).and_then(|v| u32::try_from(v).ok())
    }
}

impl FromCell for bool {
    fn from_cell(cell: &Cell) -> Option<Self> {
        i64::from_cell(cell).map(|v| v != 0)
    }
}

impl FromCell for f64 {
    fn from_cell(cell: &Cell) -> Option<Self> {
        match cell {
            Cell::Real(v) => Some(*v),
            Cell::Int(v) => Some(*v as f64),
            _ => None,
        }
    }
}

impl FromCell for String {
    fn from_cell(cell: &Cell) -> Option<Self> {
        match cell {
            Cell::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromCell for Vec<u8> {
    fn from_cell(cell: &Cell) -> Option<Self> {
        match cell {
            Cell::Blob(b) => Some(b.clone()),
            _ => None,
        }
    }
}

impl<T: FromCell> FromCell for Option<T> {
    fn from_cell(cell: &Cell) -> Option<Self> {
        match cell {
            Cell::Null => Some(None),
            other => T::from_cell(other).map(Some),
        }
    }
}

/// A connection the views run their statements on.
pub trait Sql {
    /// Which database it is.
    fn dialect(&self) -> Dialect;
    /// Every row `sql` gives.
    fn rows(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, StoreError>;
    /// Runs `sql`; the number of rows it changed.
    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, StoreError>;

    /// The first row `sql` gives, if any.
    fn first(&self, sql: &str, params: &[Param<'_>]) -> Result<Option<Row>, StoreError> {
        Ok(self.rows(sql, params)?.into_iter().next())
    }

    /// How long a commit of a process writing this database stays under
    /// way at most before that process gives up on it (this process's
    /// bound, which replicas of one configuration share): none where no
    /// other process writes.
    fn commit_timeout(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, Value, ValueRef};
        Ok(match *self {
            Param::Null => ToSqlOutput::Owned(Value::Null),
            Param::Int(v) => ToSqlOutput::Owned(Value::Integer(v)),
            Param::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Param::Blob(b) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
        })
    }
}

impl Sql for rusqlite::Connection {
    fn dialect(&self) -> Dialect {
        Dialect::Sqlite
    }

    fn rows(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, StoreError> {
        use rusqlite::types::ValueRef;
        let mut stmt = self.prepare_cached(sql)?;
        let columns = stmt.column_count();
        let mut rows = stmt.query(rusqlite::params_from_iter(params))?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let mut cells = Vec::with_capacity(columns);
            for i in 0..columns {
                cells.push(match r.get_ref(i)? {
                    ValueRef::Null => Cell::Null,
                    ValueRef::Integer(v) => Cell::Int(v),
                    ValueRef::Real(v) => Cell::Real(v),
                    ValueRef::Text(t) => Cell::Text(String::from_utf8_lossy(t).into_owned()),
                    ValueRef::Blob(b) => Cell::Blob(b.to_vec()),
                });
            }
            out.push(Row(cells));
        }
        Ok(out)
    }

    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, StoreError> {
        let mut stmt = self.prepare_cached(sql)?;
        Ok(stmt.execute(rusqlite::params_from_iter(params))? as u64)
    }
}

/// `sql` with SQLite's `?N` placeholders spelled PostgreSQL's way, `$N`.
/// The views' statements hold no `?` elsewhere (no string literal has one).
pub(super) fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_numbered_and_nothing_else_changes() {
        assert_eq!(
            numbered("SELECT a FROM t WHERE b = ?1 AND c IN (?2, ?10) -- ?"),
            "SELECT a FROM t WHERE b = $1 AND c IN ($2, $10) -- ?"
        );
    }

    #[test]
    fn sqlite_rows_come_back_as_cells_and_convert() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "CREATE TABLE t (i INTEGER, r REAL, s TEXT, b BLOB, n TEXT);
             INSERT INTO t VALUES (7, 1.5, 'x', x'0102', NULL);",
        )
        .unwrap();
        let row = conn
            .first("SELECT i, r, s, b, n FROM t WHERE i = ?1", &[Param::Int(7)])
            .unwrap()
            .expect("a row");
        assert_eq!(row.get::<i64>(0).unwrap(), 7);
        assert!(row.get::<bool>(0).unwrap());
        assert_eq!(row.get::<f64>(1).unwrap(), 1.5);
        assert_eq!(row.get::<String>(2).unwrap(), "x");
        assert_eq!(row.get::<Vec<u8>>(3).unwrap(), vec![1, 2]);
        assert_eq!(row.get::<Option<String>>(4).unwrap(), None);
        assert!(row.get::<String>(0).is_err(), "an integer is not text");
        assert_eq!(
            Sql::execute(&conn, "DELETE FROM t WHERE s = ?1", &["x".into()]).unwrap(),
            1
        );
    }
}
