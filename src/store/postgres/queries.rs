//! The PostgreSQL store's [`super::Queries`]: the views SQLite's store
//! answers (list, show, export, savings, deletion), run through [`Sql`] on
//! one pooled connection per call, from whichever replica is asked.

use std::sync::Arc;

use bytes::BytesMut;
use tokio_postgres::types::{IsNull, ToSql, Type};

use super::pool::{Options, Postgres};
use super::reads::PostgresReads;
use super::rows::plain;
use super::text::escape;
use crate::store::error::StoreError;
use crate::store::sql::{numbered, Dialect, Param, Row, Sql};
use crate::store::traits::Queries;

/// A [`Param`] that owns its value: a statement runs on the pool's runtime,
/// which outlives the caller's borrows.
#[derive(Debug)]
enum Owned {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
}

impl From<&Param<'_>> for Owned {
    fn from(p: &Param<'_>) -> Self {
        match *p {
            Param::Null => Owned::Null,
            Param::Int(v) => Owned::Int(v),
            // Escaped as every stored text is (see `text`).
            Param::Text(s) => Owned::Text(escape(s).into_owned()),
            Param::Blob(b) => Owned::Blob(b.to_vec()),
        }
    }
}

impl ToSql for Owned {
    /// An integer goes as the width the server asks for (the views' ids
    /// and counts are `BIGINT`, statuses `INTEGER`, flags `BOOLEAN`).
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Owned::Null => Ok(IsNull::Yes),
            Owned::Int(v) => match *ty {
                Type::BOOL => (*v != 0).to_sql(ty, out),
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                Type::FLOAT8 => (*v as f64).to_sql(ty, out),
                _ => v.to_sql(ty, out),
            },
            Owned::Text(s) => s.to_sql(ty, out),
            Owned::Blob(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::BOOL
                | Type::INT2
                | Type::INT4
                | Type::INT8
                | Type::FLOAT8
                | Type::TEXT
                | Type::VARCHAR
                | Type::BYTEA
        )
    }

    tokio_postgres::types::to_sql_checked!();
}

/// A connection for the views to the database `opts` names, for the CLI:
/// its schema must be current (`serve` brings it up to date).
pub fn connect(opts: &Options) -> Result<PgSql, StoreError> {
    let pg = Postgres::new(opts)?;
    let status = pg.status()?;
    if !status.is_current() {
        return Err(StoreError::Schema {
            applied: status.applied,
            latest: status.latest,
        });
    }
    PgSql::connect(&pg)
}

/// One pooled connection, held for the statements of one view.
pub struct PgSql {
    pg: Arc<Postgres>,
    /// Taken only when dropped.
    client: Option<Arc<deadpool_postgres::Object>>,
    /// A statement failed or timed out: the connection may be inside a
    /// transaction or mid-answer, so it leaves the pool for good.
    failed: std::sync::atomic::AtomicBool,
}

impl Drop for PgSql {
    fn drop(&mut self) {
        // Every statement's future is done once its wait returned (or was
        // dropped with the timeout), so the connection is this one's alone.
        let client = self.client.take().and_then(|c| Arc::try_unwrap(c).ok());
        if let Some(object) = client.filter(|_| *self.failed.get_mut()) {
            drop(deadpool_postgres::Object::take(object));
        }
    }
}

impl PgSql {
    /// A connection from `pg`'s pool.
    pub fn connect(pg: &Arc<Postgres>) -> Result<Self, StoreError> {
        let pool = pg.pool.clone();
        let client = pg.wait(async move { Ok(pool.get().await?) })?;
        Ok(PgSql {
            pg: pg.clone(),
            client: Some(Arc::new(client)),
            failed: Default::default(),
        })
    }

    /// The connection, for one statement's future.
    fn client(&self) -> Result<Arc<deadpool_postgres::Object>, StoreError> {
        self.client.clone().ok_or(StoreError::Closed)
    }

    /// `result`, remembering a failure (see `failed`).
    fn noted<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if result.is_err() {
            self.failed
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        result
    }
}

fn owned(params: &[Param<'_>]) -> Vec<Owned> {
    params.iter().map(Owned::from).collect()
}

fn refs(params: &[Owned]) -> Vec<&(dyn ToSql + Sync)> {
    params.iter().map(|p| p as &(dyn ToSql + Sync)).collect()
}

impl Sql for PgSql {
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    fn rows(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, StoreError> {
        let (sql, owned) = (numbered(sql), owned(params));
        let client = self.client()?;
        let rows = self.noted(self.pg.wait(async move {
            let stmt = client.prepare_cached(&sql).await?;
            Ok(client.query(&stmt, &refs(&owned)).await?)
        }))?;
        rows.iter().map(plain).collect()
    }

    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, StoreError> {
        let (sql, owned) = (numbered(sql), owned(params));
        let client = self.client()?;
        self.noted(self.pg.wait(async move {
            let stmt = client.prepare_cached(&sql).await?;
            Ok(client.execute(&stmt, &refs(&owned)).await?)
        }))
    }

    fn commit_timeout(&self) -> std::time::Duration {
        self.pg.commit_timeout()
    }
}

/// One pooled connection per view, from whichever replica is asked.
impl Queries for PostgresReads {
    fn views(&self) -> Result<Box<dyn Sql>, StoreError> {
        Ok(Box::new(PgSql::connect(self.pg())?))
    }
}
