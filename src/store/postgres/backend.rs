//! The writer thread's side of the PostgreSQL store: start-up's snapshot,
//! and each batch written in one transaction, sent as one pipeline of
//! multi-row statements; the exchanges of a commit that timed out written
//! again as withheld.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use super::pool::Postgres;
use super::rows::{hash_of, stored_compaction};
use super::text::{escape, escape_opt, unescape, unescape_opt};
use crate::compaction::Compaction;
use crate::store::batch::{conversation_merge, conversation_spans, ConversationSpan};
use crate::store::error::StoreError;
use crate::store::records::{ExchangeRecord, IndexedExchange, Limits, Record, Snapshot};
use crate::store::traits::Backend;
use crate::windows::{Source, Told};
use crate::wire::ItemHash;

/// The writer thread's side: batches in one transaction each.
pub struct PostgresBackend {
    pg: Arc<Postgres>,
    /// The exchanges of batches whose commit timed out after their
    /// pipeline may have been sent, as their clients were answered
    /// (withheld, see [`withheld`]): written with the next batch, whether
    /// the timed-out commit landed meanwhile, lands later or never.
    in_doubt: Vec<Record>,
}

impl PostgresBackend {
    /// The writer's backend over `pg`.
    pub fn new(pg: Arc<Postgres>) -> Self {
        PostgresBackend {
            pg,
            in_doubt: Vec::new(),
        }
    }
}

/// What an exchange whose commit timed out is recorded with: its client
/// was told the answer was withheld.
pub const WITHHELD: &str = "the answer was withheld: its commit did not finish in time";

/// `rec` as recorded once its answer was withheld: a 503, its response not
/// one a later request can continue, with every item's body.
fn withheld(rec: &Record) -> Option<Record> {
    let Record::Exchange(e) = rec else {
        return None;
    };
    // Its client was answered before the commit: the writer writes it
    // again as it is (see `Store::start_shared`).
    if e.journaled {
        return None;
    }
    let mut e = e.clone();
    // Written again later, whenever the database answers: by then a
    // deletion elsewhere may have taken the items it believed stored.
    let bodies = e.stored_items.take();
    e.new_items.extend(bodies);
    e.status = 503;
    e.partial = true;
    e.error = Some(WITHHELD.into());
    e.response_id = None;
    e.chain_full = None;
    Some(Record::Exchange(e))
}

impl Backend for PostgresBackend {
    fn load(&mut self, limits: Limits) -> Result<Snapshot, StoreError> {
        let pool = self.pg.pool.clone();
        self.pg.wait(async move { load(&pool, limits).await })
    }

    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError> {
        // The writer thread is outside any runtime: the batch is written
        // where it is, without a copy (but after a timeout, when what was in
        // doubt goes first, in the same transaction).
        let pool = self.pg.pool.clone();
        let timeout = self.pg.timeout;
        self.pg
            .health
            .busy_since_ms
            .store(crate::ids::now_ms(), Ordering::Release);
        let doubt = std::mem::take(&mut self.in_doubt);
        let ids: Vec<i64> = doubt
            .iter()
            .filter_map(|r| match r {
                Record::Exchange(e) => Some(e.id),
                _ => None,
            })
            .collect();
        let joined: Vec<Record>;
        let records = if doubt.is_empty() {
            batch
        } else {
            joined = doubt.iter().chain(batch).cloned().collect();
            &joined
        };
        let result = self
            .pg
            .handle
            .block_on(async { write(&pool, records, &ids, timeout).await });
        match &result {
            Ok(()) => {
                let exchanges = records
                    .iter()
                    .filter(|r| matches!(r, Record::Exchange(_)))
                    .count();
                self.pg.wrote(exchanges as u64);
                if !ids.is_empty() {
                    tracing::warn!(
                        exchanges = ids.len(),
                        "exchanges whose commit timed out are recorded as withheld"
                    );
                }
            }
            // Its pipeline may have been sent: the database may yet commit
            // it. Its clients are told it failed, so the next batch records
            // them so, whatever the database did with it.
            Err(StoreError::Timeout) => {
                self.in_doubt = doubt;
                self.in_doubt.extend(batch.iter().filter_map(withheld));
            }
            Err(_) => self.in_doubt = doubt,
        }
        self.pg.committed(&result);
        result
    }
}

async fn load(pool: &Pool, limits: Limits) -> Result<Snapshot, StoreError> {
    let client = pool.get().await?;
    let mut snap = Snapshot::default();
    let mut salt = [0u8; 32];
    getrandom::fill(&mut salt).map_err(|e| StoreError::Io(std::io::Error::other(e.to_string())))?;
    // The first replica's salt stays: the others read it.
    client
        .execute(
            "INSERT INTO meta (key, value) VALUES ('tenant_salt', $1) ON CONFLICT DO NOTHING",
            &[&salt.as_slice()],
        )
        .await?;
    let stored: Vec<u8> = client
        .query_one("SELECT value FROM meta WHERE key = 'tenant_salt'", &[])
        .await?
        .get(0);
    snap.salt = stored
        .as_slice()
        .try_into()
        .map_err(|_| StoreError::Pool("the stored tenant salt is not 32 bytes".into()))?;
    let rows = client
        .query(
            "SELECT id, conversation_id, tenant, request_len, length(response_items) / 32,
                    chain_request, chain_full, response_id, prefix_exchange
             FROM exchanges ORDER BY id DESC LIMIT $1",
            &[&(limits.exchanges as i64)],
        )
        .await?;
    snap.exchanges = rows
        .iter()
        .map(|r| IndexedExchange {
            id: r.get(0),
            conversation: r.get(1),
            tenant: r.get(2),
            request_len: r.get::<_, i64>(3) as usize,
            response_len: r.get::<_, i32>(4) as usize,
            chain_request: hash_of(r.get(5)),
            chain_full: hash_of(r.get(6)),
            chain_echoed: None,
            response_id: unescape_opt(r.get(7)),
            prefix_exchange: r.get(8),
        })
        .collect();
    snap.exchanges.reverse();
    let rows = client
        .query(
            "SELECT tenant, explicit_key, id FROM conversations WHERE explicit_key IS NOT NULL
             ORDER BY last_seen_ms DESC, id DESC LIMIT $1",
            &[&(limits.keys as i64 + 1)],
        )
        .await?;
    snap.keys = rows
        .iter()
        .map(|r| (r.get(0), unescape(r.get(1)), r.get(2)))
        .collect();
    snap.keys_truncated = snap.keys.len() > limits.keys;
    snap.keys.truncate(limits.keys);
    snap.keys.reverse();
    let rows = client
        .query(
            "SELECT id, tenant, conversation_id, covered_len, covered_chain, created_ms, observed
             FROM compactions ORDER BY created_ms, id",
            &[],
        )
        .await?;
    snap.compactions = rows.iter().map(stored_compaction).collect();
    let rows = client
        .query(
            r#"SELECT upstream, model, "window", source, updated_ms FROM windows
               ORDER BY upstream, model"#,
            &[],
        )
        .await?;
    snap.windows = rows
        .iter()
        .map(|r| Told {
            upstream: unescape(r.get(0)),
            model: unescape(r.get(1)),
            window: r.get::<_, i64>(2).max(0) as u64,
            source: Source::parse(r.get(3)).unwrap_or(Source::Learned),
            updated_ms: r.get(4),
        })
        .collect();
    Ok(snap)
}

/// Writes a batch in one transaction, sent as one pipeline: `BEGIN`, one
/// multi-row statement per table, `COMMIT`, all before any answer is
/// awaited, so that a commit costs one round trip however many records it
/// holds. Under load a round trip is mostly the wait for the threads at
/// either end to be scheduled, so the count of them, not of rows, is what
/// a commit's time grows with.
///
/// `withheld` are exchanges of the batch recorded so after an earlier
/// commit of theirs timed out: should that commit have landed first (the
/// batch's inserts then leave its rows), they are marked so in the same
/// transaction; should it land later, its inserts find theirs and leave
/// them. A commit still running holds their ids, and the inserts wait for
/// it.
async fn write(
    pool: &Pool,
    batch: &[Record],
    withheld: &[i64],
    timeout: Duration,
) -> Result<(), StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let client = tokio::time::timeout_at(deadline, pool.get())
        .await
        .map_err(|_| StoreError::Timeout)??;
    let written = tokio::time::timeout_at(deadline, write_pipelined(&client, batch, withheld))
        .await
        .unwrap_or(Err(StoreError::Timeout));
    if written.is_err() {
        // A statement that failed before it was sent (its parameters could
        // not be encoded) leaves the transaction open, without its COMMIT,
        // and one that timed out leaves answers due: the session is closed,
        // rather than handed to the pool's next user.
        drop(deadpool_postgres::Object::take(client));
    }
    written
}

/// Marks exchanges as withheld (see [`WITHHELD`]).
const MARK_WITHHELD: &str = "UPDATE exchanges SET status = 503, partial = TRUE, error = $2,
                                                  response_id = NULL, chain_full = NULL
                             WHERE id = ANY($1)";

/// Runs [`MARK_WITHHELD`] over `ids`, unless there are none.
async fn mark_withheld(
    client: &deadpool_postgres::ClientWrapper,
    statement: &tokio_postgres::Statement,
    ids: &[i64],
) -> Result<u64, tokio_postgres::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    client.execute(statement, &[&ids, &WITHHELD]).await
}

async fn write_pipelined(
    client: &deadpool_postgres::ClientWrapper,
    batch: &[Record],
    withheld: &[i64],
) -> Result<(), StoreError> {
    // Rows another replica's commit may take too (a conversation both
    // serve, an item both saw first) are written in one order, theirs by
    // id and by hash: two commits then wait for each other's locks in turn
    // instead of deadlocking.
    let mut spans = conversation_spans(batch);
    spans.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut new_items: Vec<&(ItemHash, String)> = batch
        .iter()
        .filter_map(|r| match r {
            Record::Exchange(e) => Some(e.new_items.iter()),
            _ => None,
        })
        .flatten()
        .collect();
    new_items.sort_unstable_by_key(|item| item.0);
    new_items.dedup_by(|a, b| a.0 == b.0);
    let mut items = Items::default();
    new_items.into_iter().for_each(|item| items.push(item));
    let mut keyed = KeyedConversations::default();
    let mut seen = SeenConversations::default();
    let mut exchanges = Exchanges::default();
    let mut compactions = Compactions::default();
    let mut windows = Windows::default();
    for span in &spans {
        if span.1.explicit_key.is_some() {
            keyed.push(span);
        }
        seen.push(span);
    }
    for rec in batch {
        match rec {
            Record::Exchange(e) => exchanges.push(e),
            Record::Compaction(c) => compactions.push(c),
            Record::Window(_) => {}
        }
    }
    // One row per (upstream, model), the batch's last: as when each was
    // upserted in turn (one statement may not update a row twice).
    let mut told = foldhash::HashSet::default();
    let mut latest: Vec<&Told> = batch
        .iter()
        .rev()
        .filter_map(|r| match r {
            Record::Window(w) => told.insert((&w.upstream, &w.model)).then_some(w),
            _ => None,
        })
        .collect();
    latest.reverse();
    latest.into_iter().for_each(|w| windows.push(w));
    // Prepared once per connection (cached by the pool), all at once.
    let statements = tokio::try_join!(
        client.prepare_cached(Items::sql()),
        client.prepare_cached(KeyedConversations::sql()),
        client.prepare_cached(SeenConversations::sql()),
        client.prepare_cached(Exchanges::sql()),
        client.prepare_cached(Compactions::sql()),
        client.prepare_cached(Windows::sql()),
        client.prepare_cached(MARK_WITHHELD),
    )?;
    // `biased`: each request is sent when first polled, so polled in this
    // order they run in it, the conversations before the exchanges that
    // refer to them. A failed statement aborts the transaction: what
    // follows it fails too, and the COMMIT rolls back.
    tokio::try_join!(
        biased;
        client.batch_execute("BEGIN"),
        insert(client, &statements.0, &items),
        insert(client, &statements.1, &keyed),
        insert(client, &statements.2, &seen),
        insert(client, &statements.3, &exchanges),
        insert(client, &statements.4, &compactions),
        insert(client, &statements.5, &windows),
        mark_withheld(client, &statements.6, withheld),
        client.batch_execute("COMMIT"),
    )?;
    Ok(())
}

/// Runs a multi-row statement over `rows`, unless there are none.
async fn insert<T: Columns>(
    client: &deadpool_postgres::ClientWrapper,
    statement: &tokio_postgres::Statement,
    rows: &T,
) -> Result<u64, tokio_postgres::Error> {
    if rows.is_empty() {
        return Ok(0);
    }
    client.execute(statement, &rows.params()).await
}

/// A table's rows held as one array per column, written by one
/// `INSERT … SELECT * FROM unnest($1::type[], …)`: one statement per table
/// however many rows, prepared once.
trait Columns {
    /// The statement.
    fn sql() -> &'static str;
    fn is_empty(&self) -> bool;
    /// The arrays, in the statement's order.
    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)>;
}

/// Declares a [`Columns`] type: each column's name, Rust element type,
/// PostgreSQL type and value from a row, in one place, so the statement
/// and its arrays cannot disagree.
macro_rules! columns {
    ($name:ident<$a:lifetime>($row:ident: $row_ty:ty) into $table:literal $conflict:tt {
        $($col:ident: $ty:ty as $pg:literal = $value:expr,)+
    }) => {
        #[derive(Default)]
        struct $name<$a> {
            rows: usize,
            $($col: Vec<$ty>,)+
        }

        impl<$a> $name<$a> {
            fn push(&mut self, $row: $row_ty) {
                self.rows += 1;
                $(self.$col.push($value);)+
            }
        }

        impl Columns for $name<'_> {
            fn sql() -> &'static str {
                static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
                    // A literal, or a call in parentheses.
                    #[allow(unused_parens)]
                    let conflict: &str = $conflict;
                    unnest_insert($table, &[$((stringify!($col), $pg)),+], conflict)
                });
                &SQL
            }

            fn is_empty(&self) -> bool {
                self.rows == 0
            }

            fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
                vec![$(&self.$col),+]
            }
        }
    };
}

/// `INSERT INTO table ("a", "b") SELECT * FROM unnest($1::ta[], $2::tb[]) conflict`.
fn unnest_insert(table: &str, columns: &[(&str, &str)], conflict: &str) -> String {
    let names: Vec<String> = columns.iter().map(|(n, _)| format!("\"{n}\"")).collect();
    let arrays: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, (_, t))| format!("${}::{t}[]", i + 1))
        .collect();
    format!(
        "INSERT INTO {table} ({}) SELECT * FROM unnest({}) {conflict}",
        names.join(", "),
        arrays.join(", ")
    )
}

type Span<'a> = (&'a str, ConversationSpan<'a>);

// Item bodies: each once across replicas.
columns! {
    Items<'a>(item: &'a (ItemHash, String)) into "items" "ON CONFLICT DO NOTHING" {
        hash: &'a [u8] as "bytea" = item.0.as_slice(),
        body: Cow<'a, str> as "text" = escape(item.1.as_str()),
    }
}

// The conversations of a batch, each once (see `ConversationSpan`). A key another conversation holds
// (committed by another replica meanwhile, or earlier) is not claimed: this
// statement then inserts nothing for it, and the next inserts the
// conversation without it.
columns! {
    KeyedConversations<'a>(span: &'a Span<'a>) into "conversations" "ON CONFLICT DO NOTHING" {
        id: &'a str as "text" = span.0,
        tenant: &'a str as "text" = span.1.tenant,
        explicit_key: Option<Cow<'a, str>> as "text" = escape_opt(span.1.explicit_key),
        created_ms: i64 as "bigint" = span.1.created_ms,
        last_seen_ms: i64 as "bigint" = span.1.last_seen_ms,
        model: Cow<'a, str> as "text" = escape(span.1.model),
    }
}

// Another replica's batch of the same conversation may commit after this
// one: the row takes it by the rule both backends share.
columns! {
    SeenConversations<'a>(span: &'a Span<'a>) into "conversations" (conversation_merge()) {
        id: &'a str as "text" = span.0,
        tenant: &'a str as "text" = span.1.tenant,
        created_ms: i64 as "bigint" = span.1.created_ms,
        last_seen_ms: i64 as "bigint" = span.1.last_seen_ms,
        model: Cow<'a, str> as "text" = escape(span.1.model),
        preview: Option<Cow<'a, str>> as "text" = escape_opt(span.1.preview),
        client: Option<Cow<'a, str>> as "text" = escape_opt(span.1.client),
        conversation_header: Option<Cow<'a, str>> as "text" = escape_opt(span.1.ids.header.as_deref()),
        session_id: Option<Cow<'a, str>> as "text" = escape_opt(span.1.ids.session.as_deref()),
        prompt_cache_key: Option<Cow<'a, str>> as "text" = escape_opt(span.1.ids.cache_key.as_deref()),
    }
}

columns! {
    Exchanges<'a>(r: &'a ExchangeRecord) into "exchanges" "ON CONFLICT (id) DO NOTHING" {
        id: i64 as "bigint" = r.id,
        conversation_id: &'a str as "text" = &r.conversation,
        tenant: &'a str as "text" = &r.tenant,
        endpoint: &'a str as "text" = r.api.endpoint(),
        model: Cow<'a, str> as "text" = escape(&r.model),
        prefix_exchange: Option<i64> as "bigint" = r.prefix.map(|p| p.exchange),
        prefix_len: i64 as "bigint" = r.prefix.map_or(0, |p| p.len as i64),
        prefix_full: bool as "boolean" = r.prefix.is_some_and(|p| p.full),
        suffix_items: &'a [u8] as "bytea" = r.suffix_items.as_flattened(),
        request_len: i64 as "bigint" = r.request_len as i64,
        params: &'a [u8] as "bytea" = r.params.as_slice(),
        response_items: &'a [u8] as "bytea" = r.response_items.as_flattened(),
        response_id: Option<Cow<'a, str>> as "text" = escape_opt(r.response_id.as_deref()),
        input_tokens: Option<i64> as "bigint" = r.usage.map(|u| u.input_tokens as i64),
        output_tokens: Option<i64> as "bigint" = r.usage.map(|u| u.output_tokens as i64),
        cached_tokens: Option<i64> as "bigint" =
            r.usage.and_then(|u| u.cached_tokens).map(|c| c as i64),
        status: i32 as "integer" = i32::from(r.status),
        streamed: bool as "boolean" = r.streamed,
        partial: bool as "boolean" = r.partial,
        error: Option<Cow<'a, str>> as "text" = escape_opt(r.error.as_deref()),
        started_ms: i64 as "bigint" = r.started_ms,
        latency_ms: f64 as "double precision" = r.latency_ms,
        ttfb_ms: Option<f64> as "double precision" = r.ttfb_ms,
        chain_request: Option<&'a [u8]> as "bytea" = r.chain_request.as_ref().map(|h| h.as_slice()),
        chain_full: Option<&'a [u8]> as "bytea" = r.chain_full.as_ref().map(|h| h.as_slice()),
        compaction_id: Option<&'a str> as "text" = r.compaction.as_deref(),
        context_window: Option<i64> as "bigint" = r.window.map(|w| w.tokens as i64),
        window_source: Option<&'a str> as "text" = r.window.map(|w| w.source.as_str()),
        client: Option<Cow<'a, str>> as "text" = escape_opt(r.client.as_deref()),
        conversation_header: Option<Cow<'a, str>> as "text" = escape_opt(r.client_ids.header.as_deref()),
        session_id: Option<Cow<'a, str>> as "text" = escape_opt(r.client_ids.session.as_deref()),
        prompt_cache_key: Option<Cow<'a, str>> as "text" = escape_opt(r.client_ids.cache_key.as_deref()),
        mode: &'a str as "text" = r.savings.mode.as_str(),
        tokens_saved: i64 as "bigint" = r.savings.tokens_saved as i64,
        tokens_saved_potential: i64 as "bigint" = r.savings.tokens_saved_potential as i64,
        observed_compaction: Option<&'a str> as "text" = r.savings.observed_compaction.as_deref(),
        recall_rounds: i64 as "bigint" = i64::from(r.savings.recall_rounds),
        recall_input_tokens: i64 as "bigint" = r.savings.recall_input_tokens as i64,
        recall_output_tokens: i64 as "bigint" = r.savings.recall_output_tokens as i64,
        branched_from: Option<Cow<'a, str>> as "text" = escape_opt(r.branched_from.as_deref()),
        cache_write_tokens: Option<i64> as "bigint" =
            r.usage.and_then(|u| u.cache_write_tokens).map(|c| c as i64),
        cache_write_1h_tokens: Option<i64> as "bigint" =
            r.usage.and_then(|u| u.cache_write_1h_tokens).map(|c| c as i64),
    }
}

columns! {
    Compactions<'a>(c: &'a Compaction) into "compactions" "ON CONFLICT (id) DO NOTHING" {
        id: &'a str as "text" = &c.id,
        tenant: &'a str as "text" = &c.tenant,
        conversation_id: &'a str as "text" = &c.conversation,
        covered_len: i64 as "bigint" = c.covered_len as i64,
        covered_chain: &'a [u8] as "bytea" = c.covered_chain.as_slice(),
        replacement: String as "text" =
            serde_json::to_string(&c.replacement).unwrap_or_else(|_| "[]".into()),
        rung: &'a str as "text" = c.rung.as_str(),
        reason: Cow<'a, str> as "text" = escape(&c.reason),
        tokens_before: i64 as "bigint" = c.tokens_before as i64,
        tokens_after: i64 as "bigint" = c.tokens_after as i64,
        items_removed: i64 as "bigint" = c.items_removed as i64,
        items_kept: i64 as "bigint" = c.items_kept as i64,
        summary: Option<Cow<'a, str>> as "text" = escape_opt(c.summary.as_deref()),
        facts: Option<String> as "text" =
            c.facts.as_ref().and_then(|f| serde_json::to_string(f).ok()),
        base_id: Option<&'a str> as "text" = c.base.as_deref(),
        summary_calls: i64 as "bigint" = i64::from(c.summary_calls),
        duration_ms: i64 as "bigint" = c.duration_ms as i64,
        created_ms: i64 as "bigint" = c.created_ms,
        summary_tokens: i64 as "bigint" = c.summary_tokens as i64,
        summary_output_tokens: i64 as "bigint" = c.summary_output_tokens as i64,
        tokens_saved: i64 as "bigint" = c.tokens_saved as i64,
        observed: bool as "boolean" = c.observed,
        audit: Option<String> as "text" =
            c.audit.as_ref().and_then(|a| serde_json::to_string(a).ok()),
        summary_cached_tokens: i64 as "bigint" = c.summary_cache.read as i64,
        summary_cache_write_tokens: i64 as "bigint" = c.summary_cache.write as i64,
        summary_cache_write_1h_tokens: i64 as "bigint" = c.summary_cache.write_1h as i64,
    }
}

columns! {
    Windows<'a>(w: &'a Told) into "windows"
    "ON CONFLICT (upstream, model) DO UPDATE SET \"window\" = excluded.\"window\",
         source = excluded.source, updated_ms = excluded.updated_ms" {
        upstream: Cow<'a, str> as "text" = escape(&w.upstream),
        model: Cow<'a, str> as "text" = escape(&w.model),
        window: i64 as "bigint" = w.window as i64,
        source: &'a str as "text" = w.source.as_str(),
        updated_ms: i64 as "bigint" = w.updated_ms,
    }
}
