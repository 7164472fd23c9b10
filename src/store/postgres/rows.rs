//! PostgreSQL's rows as the store reads them: as the plain values the
//! readers written once for both backends take, a compaction's row, a hash.

use tokio_postgres::types::Type;

use super::text::unescape;
use crate::store::error::StoreError;
use crate::store::records::StoredCompaction;
use crate::store::sql::{Cell, Row};
use crate::wire::ItemHash;

/// Column `i` of `row` as a [`Cell`].
fn cell(row: &tokio_postgres::Row, i: usize) -> Result<Cell, StoreError> {
    let ty = row.columns()[i].type_().clone();
    let int = |v: Option<i64>| v.map_or(Cell::Null, Cell::Int);
    Ok(match ty {
        Type::INT8 => int(row.try_get(i)?),
        Type::INT4 => int(row.try_get::<_, Option<i32>>(i)?.map(i64::from)),
        Type::INT2 => int(row.try_get::<_, Option<i16>>(i)?.map(i64::from)),
        Type::BOOL => int(row.try_get::<_, Option<bool>>(i)?.map(i64::from)),
        Type::FLOAT8 => row
            .try_get::<_, Option<f64>>(i)?
            .map_or(Cell::Null, Cell::Real),
        Type::TEXT | Type::VARCHAR | Type::NAME => row
            .try_get::<_, Option<String>>(i)?
            .map_or(Cell::Null, |s| Cell::Text(unescape(s))),
        Type::BYTEA => row
            .try_get::<_, Option<Vec<u8>>>(i)?
            .map_or(Cell::Null, Cell::Blob),
        _ => {
            return Err(StoreError::Column {
                index: i,
                wanted: "type the views read",
            })
        }
    })
}

/// `row` as the plain values the readers written once for both backends
/// take (see [`crate::store::rows`]).
pub(super) fn plain(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
    (0..row.len())
        .map(|i| cell(row, i))
        .collect::<Result<_, _>>()
        .map(Row)
}

/// A hash column's bytes as a hash (none if they are not one).
pub(super) fn hash_of(bytes: Option<Vec<u8>>) -> Option<ItemHash> {
    bytes.and_then(|b| b.as_slice().try_into().ok())
}

/// A row of `compactions` (id, tenant, conversation, covered length and
/// chain, created, observed) as the registry keeps it.
pub(super) fn stored_compaction(r: &tokio_postgres::Row) -> StoredCompaction {
    StoredCompaction {
        id: r.get(0),
        tenant: r.get(1),
        conversation: r.get(2),
        covered_len: r.get::<_, i64>(3) as usize,
        covered_chain: hash_of(r.get(4)).unwrap_or([0; 32]),
        created_ms: r.get(5),
        observed: r.get(6),
    }
}
