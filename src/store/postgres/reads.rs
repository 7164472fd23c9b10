//! The PostgreSQL store's point reads, the lookups by which every replica
//! finds what another recorded, and its rows as the shared views read them.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use deadpool_postgres::Pool;
use tokio_postgres::types::Type;

use super::backend::stored_compaction;
use super::{Options, Postgres};
use crate::compaction::Compaction;
use crate::store::postgres_text::{escape, escape_opt, unescape, unescape_opt};
use crate::store::rows::COMPACTION_COLUMNS;
use crate::store::sql::{Cell, Row};
use crate::store::{
    AttemptRecord, ChainHit, Found, LookUp, PrefixRef, ReadFuture, StoreError, StoredCompaction,
};
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
pub(in crate::store) fn plain(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
    (0..row.len())
        .map(|i| cell(row, i))
        .collect::<Result<_, _>>()
        .map(Row)
}

/// The point reads of a PostgreSQL store, and the lookups that let every
/// replica find what another recorded.
pub struct PostgresReads {
    pg: Arc<Postgres>,
    /// Names this process in compaction claims.
    owner: String,
    /// The manual compactions this process heard are pending.
    manual: crate::store::postgres_listen::Heard,
}

impl PostgresReads {
    /// Reads over `pg`.
    pub fn new(pg: Arc<Postgres>) -> Self {
        PostgresReads {
            pg,
            owner: crate::ids::new_conversation_id().replacen("conv_", "replica_", 1),
            manual: Default::default(),
        }
    }

    /// The pool the reads use.
    pub(in crate::store) fn pg(&self) -> &Arc<Postgres> {
        &self.pg
    }

    /// Runs a read; a failure is logged and reads as nothing found, as
    /// with SQLite.
    fn read<T, F>(&self, what: &'static str, f: impl FnOnce(Pool) -> F) -> Option<T>
    where
        T: Send + 'static,
        F: Future<Output = Result<Option<T>, StoreError>> + Send + 'static,
    {
        self.pg.counted();
        match self.pg.wait(f(self.pg.pool.clone())) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, read = what, "cannot read the store");
                None
            }
        }
    }
}

/// The longest hit of [`crate::store::Reads::look_up`]'s prefix among rows of
/// (id, conversation, request_len, response_len, request matched, full
/// matched, answered whole, tip).
fn best_hit(rows: &[tokio_postgres::Row]) -> Option<ChainHit> {
    rows.iter()
        .flat_map(|r| {
            let (id, conversation): (i64, String) = (r.get(0), r.get(1));
            let (req, resp): (i64, i32) = (r.get(2), r.get(3));
            let (on_request, on_full): (bool, bool) = (r.get(4), r.get(5));
            let (answered, tip): (bool, bool) = (r.get(6), r.get(7));
            let full = on_full.then_some(PrefixRef {
                exchange: id,
                len: req as usize + resp as usize,
                full: true,
            });
            let request = on_request.then_some(PrefixRef {
                exchange: id,
                len: req as usize,
                full: false,
            });
            [full, request]
                .into_iter()
                .flatten()
                .map(move |prefix| ChainHit {
                    conversation: conversation.clone(),
                    prefix,
                    answered,
                    tip,
                })
        })
        // The longest; among equals the newest exchange.
        .max_by_key(|h| (h.prefix.len, h.prefix.exchange))
}

impl crate::store::Reads for PostgresReads {
    fn compaction(&self, id: &str) -> Option<Compaction> {
        let id = id.to_string();
        self.read("compaction", |pool| async move {
            let client = pool.get().await?;
            let sql = format!("SELECT {COMPACTION_COLUMNS} FROM compactions WHERE id = $1");
            let stmt = client.prepare_cached(&sql).await?;
            match client.query_opt(&stmt, &[&id]).await? {
                Some(r) => Ok(Some(crate::store::rows::compaction(&plain(&r)?)?)),
                None => Ok(None),
            }
        })
    }

    fn conversation_of_key(&self, tenant: &str, key: &str) -> Option<String> {
        let (tenant, key) = (tenant.to_string(), escape(key).into_owned());
        self.read("conversation_of_key", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT id FROM conversations WHERE tenant = $1 AND explicit_key = $2",
                )
                .await?;
            Ok(client
                .query_opt(&stmt, &[&tenant, &key])
                .await?
                .map(|r| r.get(0)))
        })
    }

    fn response_history(&self, tenant: &str, response_id: &str) -> Option<Vec<serde_json::Value>> {
        let (tenant, response_id) = (tenant.to_string(), escape(response_id).into_owned());
        self.read("response_history", |pool| async move {
            let client = pool.get().await?;
            response_history(&client, &tenant, &response_id).await
        })
    }

    fn shared(&self) -> bool {
        true
    }

    fn conversation_of_response(&self, tenant: &str, response_id: &str) -> Option<String> {
        let (tenant, response_id) = (tenant.to_string(), escape(response_id).into_owned());
        self.read("conversation_of_response", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT conversation_id FROM exchanges WHERE tenant = $1 AND response_id = $2
                     ORDER BY id DESC LIMIT 1",
                )
                .await?;
            Ok(client
                .query_opt(&stmt, &[&tenant, &response_id])
                .await?
                .map(|r| r.get(0)))
        })
    }

    fn compaction_covering(&self, tenant: &str, chains: &[ItemHash]) -> Option<StoredCompaction> {
        if chains.is_empty() {
            return None;
        }
        let tenant = tenant.to_string();
        let chains: Vec<Vec<u8>> = chains.iter().map(|c| c.to_vec()).collect();
        self.read("compaction_covering", |pool| async move {
            let client = pool.get().await?;
            let stmt = client.prepare_cached(COVERING).await?;
            Ok(client
                .query_opt(&stmt, &[&tenant, &chains])
                .await?
                .map(|r| stored_compaction(&r)))
        })
    }

    fn newest_compaction_ms(&self, tenant: &str, conversation: &str) -> Option<i64> {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        self.read("newest_compaction_ms", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT MAX(created_ms) FROM compactions
                     WHERE tenant = $1 AND conversation_id = $2 AND NOT observed",
                )
                .await?;
            Ok(client
                .query_one(&stmt, &[&tenant, &conversation])
                .await?
                .get(0))
        })
    }

    fn claim(&self, tenant: &str, conversation: &str, _for_ms: i64) -> bool {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        let owner = self.owner.clone();
        // The lapse is the deployment's (`store.claim_lapse_secs`): every
        // replica of one database should be given the same.
        let for_ms = self.pg.claim_lapse.as_millis() as i64;
        // An expired claim (its replica died, or overran) is taken over.
        let claimed = self.read("claim", |pool| async move {
            let client = pool.get().await?;
            let now = crate::ids::now_ms();
            let stmt = client
                .prepare_cached(
                    "INSERT INTO compaction_claims (tenant, conversation_id, owner, expires_ms)
                     VALUES ($1, $2, $3, $4)
                     ON CONFLICT (tenant, conversation_id) DO UPDATE
                         SET owner = excluded.owner, expires_ms = excluded.expires_ms
                         WHERE compaction_claims.expires_ms < $5
                     RETURNING owner",
                )
                .await?;
            let row = client
                .query_opt(
                    &stmt,
                    &[&tenant, &conversation, &owner, &(now + for_ms), &now],
                )
                .await?;
            Ok(Some(row.is_some()))
        });
        claimed.unwrap_or(false)
    }

    fn release(&self, tenant: &str, conversation: &str) {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        let owner = self.owner.clone();
        self.read("release", |pool| async move {
            let client = pool.get().await?;
            client
                .execute(
                    "DELETE FROM compaction_claims
                     WHERE tenant = $1 AND conversation_id = $2 AND owner = $3",
                    &[&tenant, &conversation, &owner],
                )
                .await?;
            Ok(Some(()))
        });
    }

    fn request_manual(&self, conversation: &str) -> Result<bool, StoreError> {
        let owned = conversation.to_string();
        let pool = self.pg.pool.clone();
        let newly = self.pg.wait(async move {
            let mut client = pool.get().await?;
            crate::store::postgres_listen::request(&mut client, &owned).await
        })?;
        // Committed: if another replica takes it first, the take here finds
        // no row and forgets it.
        self.manual.hear(conversation);
        Ok(newly)
    }

    fn manual_pending(&self, conversation: &str) -> Result<bool, StoreError> {
        let conversation = conversation.to_string();
        let pool = self.pg.pool.clone();
        self.pg.wait(async move {
            let client = pool.get().await?;
            crate::store::postgres_listen::pending(&client, &conversation).await
        })
    }

    fn manual_heard(&self, conversation: &str) -> bool {
        self.manual.contains(conversation)
    }

    fn take_manual(&self, tenant: &str, conversation: &str) -> bool {
        let (tenant, owned) = (tenant.to_string(), conversation.to_string());
        let taken = self.read("take_manual", |pool| async move {
            let client = pool.get().await?;
            crate::store::postgres_listen::take(&client, &tenant, &owned)
                .await
                .map(Some)
        });
        match taken {
            // Taken here, or by another replica first: nothing to hear of.
            Some(taken) => {
                self.manual.forget(conversation);
                taken
            }
            // The database did not answer: the next request tries again.
            None => false,
        }
    }

    fn on_forgotten(&self, f: Box<dyn Fn(&str) + Send + Sync>) {
        self.manual.on_forget(f);
    }

    fn look_up(&self, tenant: &str, chains: &[ItemHash], ask: LookUp) -> ReadFuture<Found> {
        self.pg.look_up(tenant, chains, ask)
    }

    fn on_compacted(&self, f: Box<dyn Fn(StoredCompaction) + Send + Sync>) {
        self.manual.on_compacted(Box::new(move |p| {
            Postgres::announced(p).into_iter().for_each(&f)
        }));
    }

    fn hearing(&self) -> Option<u64> {
        self.manual.hearing()
    }

    fn record_attempt(&self, tenant: &str, conversation: &str, attempt: &AttemptRecord) {
        let (tenant, conversation, a) = (
            tenant.to_string(),
            conversation.to_string(),
            attempt.clone(),
        );
        self.read("record_attempt", |pool| async move {
            let client = pool.get().await?;
            // The newest stays, whichever replica commits last.
            let stmt = client
                .prepare_cached(
                    "INSERT INTO compaction_attempts
                         (conversation_id, tenant, at_ms, result, tokens_before, tokens_after,
                          error)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)
                     ON CONFLICT (conversation_id) DO UPDATE
                         SET at_ms = excluded.at_ms, result = excluded.result,
                             tokens_before = excluded.tokens_before,
                             tokens_after = excluded.tokens_after, error = excluded.error
                         WHERE compaction_attempts.at_ms <= excluded.at_ms",
                )
                .await?;
            let tokens = |t: Option<u64>| t.map(|t| t as i64);
            client
                .execute(
                    &stmt,
                    &[
                        &conversation,
                        &tenant,
                        &a.at_ms,
                        &a.result,
                        &tokens(a.tokens_before),
                        &tokens(a.tokens_after),
                        &escape_opt(a.error.as_deref()),
                    ],
                )
                .await?;
            Ok(Some(()))
        });
    }

    fn latest_attempt(&self, tenant: &str, conversation: &str) -> Option<AttemptRecord> {
        let (tenant, conversation) = (tenant.to_string(), conversation.to_string());
        self.read("latest_attempt", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT at_ms, result, tokens_before, tokens_after, error
                     FROM compaction_attempts WHERE tenant = $1 AND conversation_id = $2",
                )
                .await?;
            let tokens = |t: Option<i64>| t.map(|t| t.max(0) as u64);
            Ok(client
                .query_opt(&stmt, &[&tenant, &conversation])
                .await?
                .map(|r| AttemptRecord {
                    at_ms: r.get(0),
                    result: r.get(1),
                    tokens_before: tokens(r.get(2)),
                    tokens_after: tokens(r.get(3)),
                    error: unescape_opt(r.get(4)),
                }))
        })
    }
}

/// [`crate::store::rows::response_history`] over PostgreSQL: the prefix
/// references followed back in one recursive query, the bodies read in one.
async fn response_history(
    client: &tokio_postgres::Client,
    tenant: &str,
    response_id: &str,
) -> Result<Option<Vec<serde_json::Value>>, StoreError> {
    let Some(found) = client
        .query_opt(
            "SELECT id FROM exchanges
             WHERE tenant = $1 AND response_id = $2 AND status BETWEEN 200 AND 299
                   AND NOT partial
             ORDER BY id DESC LIMIT 1",
            &[&tenant, &response_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let id: i64 = found.get(0);
    let rows = client
        .query(
            "WITH RECURSIVE chain(id, prefix_exchange, prefix_len, prefix_full, suffix_items,
                                  response_items, depth) AS (
                 SELECT id, prefix_exchange, prefix_len, prefix_full, suffix_items,
                        response_items, 0
                 FROM exchanges WHERE id = $1
                 UNION ALL
                 SELECT e.id, e.prefix_exchange, e.prefix_len, e.prefix_full, e.suffix_items,
                        e.response_items, c.depth + 1
                 FROM exchanges e JOIN chain c ON e.id = c.prefix_exchange
             )
             SELECT prefix_exchange, prefix_len, prefix_full, suffix_items, response_items
             FROM chain ORDER BY depth DESC",
            &[&id],
        )
        .await?;
    let links: Vec<crate::store::sqlite::Link> = rows
        .iter()
        .map(|r| {
            (
                r.get::<_, Option<i64>>(0),
                r.get::<_, i64>(1) as usize,
                r.get(2),
                crate::store::sqlite::unpack_hashes(r.get(3)),
                crate::store::sqlite::unpack_hashes(r.get(4)),
            )
        })
        .collect();
    let Some(last) = links.last() else {
        return Ok(None);
    };
    let response = last.4.clone();
    let mut hashes = crate::store::sqlite::rebuild_items(links);
    hashes.extend(response);
    let wanted: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
    let rows = client
        .query(
            "SELECT hash, body FROM items WHERE hash = ANY($1)",
            &[&wanted],
        )
        .await?;
    let bodies: foldhash::HashMap<Vec<u8>, String> = rows
        .iter()
        .map(|r| (r.get(0), unescape(r.get(1))))
        .collect();
    let mut items = Vec::with_capacity(hashes.len());
    for h in &hashes {
        let Some(body) = bodies.get(h.as_slice()) else {
            return Ok(None);
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
            return Ok(None);
        };
        if !crate::wire::responses::is_instructions_item(&v) {
            items.push(v);
        }
    }
    Ok(Some(items))
}

impl PostgresReads {
    /// Makes this process hear of manual compactions whichever replica was
    /// asked (see [`crate::store::postgres_listen`]): returns once the pending ones
    /// are read, or the database could not be reached for them in time
    /// (then it keeps trying in the background).
    pub fn listening(self, opts: &Options) -> Result<Self, StoreError> {
        let started = self.manual.listen(&self.pg.handle, opts.pg_config()?);
        // Read before the first request is served, so that a compaction
        // asked for while no replica was up applies to it.
        let _ = self.pg.wait(async move {
            let _ = started.await;
            Ok(())
        });
        Ok(self)
    }
}

/// The request path's reads of what other replicas recorded, awaited
/// rather than waited for, and what replicas announce: the longest
/// recorded prefix of a request and the compaction covering the most of
/// it, asked together in one round trip (the two statements are sent
/// before either answer is awaited) on the backend's runtime, so that no
/// request's worker blocks; and every compaction stored, announced on
/// [`crate::store::postgres_listen::COMPACTED`] by a trigger, so that a replica
/// that hears them all asks for a conversation's compactions only once.
impl Postgres {
    /// Round trips the request path's reads of the database made
    /// (`compactor_store_reads_total`): a [`crate::store::Reads::look_up`]'s
    /// statements one, whatever they ask; a batch of branch probes one,
    /// however many requests it answers; each other read of
    /// [`PostgresReads`] one.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    fn counted(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// [`crate::store::Reads::look_up`], run on the backend's runtime.
    ///
    /// A request that goes on from this replica's own answer, asking for no
    /// compaction, asks only whether an exchange left its conversation, in
    /// one round trip with the other requests asking that meanwhile
    /// ([`BranchProbes`]); only if one did are its chains probed, in a
    /// second.
    fn look_up(&self, tenant: &str, chains: &[ItemHash], ask: LookUp) -> ReadFuture<Found> {
        let from = |at: Option<usize>| {
            at.filter(|&at| at < chains.len())
                .map(|at| chains[at..].iter().map(|c| c.to_vec()).collect::<Vec<_>>())
        };
        let (prefix, covering) = (from(ask.prefix_from), from(ask.covering_from));
        let goes_on = ask.goes_on.filter(|_| prefix.is_some());
        let (body_of, covering) = match (ask.body_of, covering) {
            (None, None) => (None, None),
            (body_of, covering) => (body_of, Some(covering.unwrap_or_default())),
        };
        if prefix.is_none() && covering.is_none() {
            return Box::pin(std::future::ready(Found::default()));
        }
        let probe = match (&goes_on, &covering) {
            (Some(conversation), None) => Some(self.branched(tenant, conversation)),
            _ => None,
        };
        let (pool, timeout, tenant) = (self.pool.clone(), self.timeout, tenant.to_string());
        let (handle, reads) = (self.handle.clone(), self.reads.clone());
        let full = move || {
            reads.fetch_add(1, Ordering::Relaxed);
            handle.spawn(async move {
                let read = look_up(&pool, &tenant, prefix, covering, body_of, goes_on);
                tokio::time::timeout(timeout, read)
                    .await
                    .unwrap_or(Err(StoreError::Timeout))
            })
        };
        let warned = |e: &dyn std::fmt::Display| {
            tracing::warn!(error = %e, read = "look_up", "cannot read the store");
            Found::default()
        };
        Box::pin(async move {
            if let Some(probe) = probe {
                match probe.await {
                    // Nothing left the conversation: memory's prefix stands.
                    Ok(Ok(false)) => {
                        return Found {
                            answered: true,
                            ..Found::default()
                        }
                    }
                    Ok(Ok(true)) => {}
                    Ok(Err(e)) => return warned(&e),
                    Err(e) => return warned(&e),
                }
            }
            match full().await {
                Ok(Ok(found)) => found,
                Ok(Err(e)) => warned(&e),
                Err(e) => warned(&e),
            }
        })
    }

    /// Whether an exchange of `tenant` left `conversation`, asked with the
    /// other probes waiting (see [`BranchProbes`]).
    fn branched(
        &self,
        tenant: &str,
        conversation: &str,
    ) -> tokio::sync::oneshot::Receiver<Result<bool, Arc<StoreError>>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let probes = self.branches.get_or_init(|| {
            let (probes, asked) = tokio::sync::mpsc::unbounded_channel();
            self.handle.spawn(probe_branches(
                asked,
                self.pool.clone(),
                self.timeout,
                self.reads.clone(),
            ));
            BranchProbes(probes)
        });
        // A closed loop (the runtime shutting down) drops `tx`: the
        // receiver then reads as a failed read.
        let _ = probes.0.send(Probe {
            tenant: tenant.to_string(),
            conversation: escape(conversation).into_owned(),
            answer: tx,
        });
        rx
    }

    /// The compaction a [`crate::store::postgres_listen::COMPACTED`] announcement
    /// tells of: `tenant id covered_len covered_chain created_ms
    /// conversation`, the chain in hex.
    fn announced(payload: &str) -> Option<StoredCompaction> {
        let mut parts = payload.splitn(6, ' ');
        let mut next = || parts.next().filter(|p| !p.is_empty());
        let (tenant, id) = (next()?.to_string(), next()?.to_string());
        let covered_len = next()?.parse().ok()?;
        let covered_chain = *blake3::Hash::from_hex(next()?).ok()?.as_bytes();
        let created_ms = next()?.parse().ok()?;
        Some(StoredCompaction {
            id,
            tenant,
            conversation: next()?.to_string(),
            covered_len,
            covered_chain,
            created_ms,
            observed: false,
        })
    }
}

/// How many of a request's last chains [`by_chain`] probes first.
const NEAR_CHAINS: usize = 16;

/// The statement of [`crate::store::Reads::look_up`]'s prefix: rows for
/// [`best_hit`], probing chains `$2` (the request's last [`NEAR_CHAINS`])
/// and, only when those match nothing, chains `$3` (the earlier ones).
///
/// A conversation's next turn extends a prefix already recorded, so one of
/// its last chains matches; the earlier ones then name only shorter
/// prefixes, which [`best_hit`] would pass over. Probing every chain of a
/// long conversation new to a replica read every earlier exchange of it
/// (up to the `LIMIT`) each turn; the second branch's `NOT EXISTS` is a
/// one-time filter, so when the near chains match it is never run.
///
/// The chains reach the index scans through a sub-select
/// (`(SELECT $2::bytea[])::bytea[]`, the cast making it an array, not a
/// subquery, to `ANY`): the planner then cannot count them. Counted, it
/// expects as many matches as chains, and plans the `LIMIT` as a walk down
/// the primary key that filters each row, which reads the whole table when
/// nothing matches (a conversation new to every replica), and hashes every
/// `prefix_exchange`. Uncounted, it probes the two chain indexes, at a
/// cost that grows with the chains and not with the table.
///
/// Whether a row is its conversation's tip is a sub-select with a `LIMIT`,
/// not a `NOT EXISTS`: the planner may run that as a hash of every row's
/// `prefix_exchange` (it did at a few thousand rows, half the statement's
/// time), and a `LIMIT`ed sub-select it can only run per row, one probe of
/// `exchanges_prefix` for each of the few rows found.
///
/// `$4`, when not null, is the conversation memory says the request goes
/// on in ([`crate::store::LookUp::goes_on`]): the chains are then probed
/// only if an exchange left it (`exchanges_branched`, a one-time filter
/// too), else nothing is found and memory's prefix stands.
///
/// Every parameter reaches the plan through a sub-select, so a plan made
/// for the values of one call is no cheaper than the generic one: the
/// plan cache then keeps the generic plan after a connection's first
/// calls. Given as values, the tenant (its share of the rows) and a null
/// `$4` (the branch probe folded away) made each call's own plan look
/// cheaper, and the statement was planned again at every call, which
/// cost the database as much as running it.
fn by_chain() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        let matching = |chains: &str, unless: &str| {
            format!(
                "SELECT id, conversation_id, request_len, length(response_items) / 32,
                        COALESCE(chain_request = ANY({chains}), FALSE),
                        COALESCE(chain_full = ANY({chains}), FALSE),
                        chain_full IS NOT NULL,
                        (SELECT 1 FROM exchanges later WHERE later.prefix_exchange = e.id
                         LIMIT 1) IS NULL
                 FROM exchanges e
                 WHERE tenant = (SELECT $1::text)
                       AND (chain_request = ANY((SELECT {chains}::bytea[])::bytea[])
                            OR chain_full = ANY((SELECT {chains}::bytea[])::bytea[])){unless}
                       AND ((SELECT $4::text) IS NULL
                            OR EXISTS (SELECT 1 FROM exchanges b
                                       WHERE b.tenant = (SELECT $1::text)
                                             AND b.branched_from = (SELECT $4::text)))
                 ORDER BY id DESC LIMIT 64"
            )
        };
        format!(
            "WITH near AS MATERIALIZED ({})
             SELECT * FROM near
             UNION ALL ({})",
            matching("$2", ""),
            matching("$3", " AND NOT EXISTS (SELECT 1 FROM near)")
        )
    })
}

/// One request's question to [`probe_branches`]: did an exchange of
/// `tenant` leave `conversation` (stored escaped, as `branched_from` is)?
struct Probe {
    tenant: String,
    conversation: String,
    answer: tokio::sync::oneshot::Sender<Result<bool, Arc<StoreError>>>,
}

/// The queue of [`Probe`]s of a process, which one task on the backend's
/// runtime answers.
pub(super) struct BranchProbes(tokio::sync::mpsc::UnboundedSender<Probe>);

/// Most probes one statement asks.
const PROBES_AT_ONCE: usize = 256;

/// Which of `$1`/`$2` (tenants, conversations) an exchange left, by
/// position from 1: one probe of `exchanges_branched` each.
///
/// The arrays reach the plan through sub-selects (as in [`by_chain`]): the
/// plan for a call's own arrays counted them, looked cheaper than the
/// generic one, and the statement was planned at every call, at ten times
/// the cost of running it. The probe is a `LIMIT`ed sub-select, not an
/// `EXISTS`, which the planner may run as a hash of every branch recorded.
const BRANCHED: &str = "SELECT q.i
 FROM unnest((SELECT $1::text[])::text[], (SELECT $2::text[])::text[]) WITH ORDINALITY
     AS q(tenant, conversation, i)
 WHERE (SELECT 1 FROM exchanges b
        WHERE b.tenant = q.tenant AND b.branched_from = q.conversation LIMIT 1) IS NOT NULL";

/// Answers the probes as they come, one statement (one round trip) for
/// all that came while the one before was under way: behind a round-robin
/// balancer every request of a replica asks one, and the database's cost
/// of a round trip is most of what it spends on a probe. A probe that
/// finds none waiting goes at once.
async fn probe_branches(
    mut asked: tokio::sync::mpsc::UnboundedReceiver<Probe>,
    pool: Pool,
    timeout: std::time::Duration,
    reads: Arc<std::sync::atomic::AtomicU64>,
) {
    while let Some(first) = asked.recv().await {
        let mut batch = vec![first];
        while batch.len() < PROBES_AT_ONCE {
            match asked.try_recv() {
                Ok(probe) => batch.push(probe),
                Err(_) => break,
            }
        }
        reads.fetch_add(1, Ordering::Relaxed);
        let tenants: Vec<&str> = batch.iter().map(|p| p.tenant.as_str()).collect();
        let conversations: Vec<&str> = batch.iter().map(|p| p.conversation.as_str()).collect();
        let found = tokio::time::timeout(timeout, async {
            let client = pool.get().await?;
            let statement = client.prepare_cached(BRANCHED).await?;
            let rows = client
                .query(&statement, &[&tenants, &conversations])
                .await?;
            rows.iter()
                .map(|r| r.try_get::<_, i64>(0).map_err(StoreError::from))
                .collect::<Result<foldhash::HashSet<i64>, _>>()
        })
        .await
        .unwrap_or(Err(StoreError::Timeout));
        let found = found.map_err(Arc::new);
        for (i, probe) in batch.into_iter().enumerate() {
            let answer = match &found {
                Ok(left) => Ok(left.contains(&(i as i64 + 1))),
                Err(e) => Err(e.clone()),
            };
            let _ = probe.answer.send(answer);
        }
    }
}

/// The statement of [`crate::store::Reads::look_up`]'s compaction: the one
/// covering the most among chains `$2`, or else compaction `$3`, whole
/// (its parameters in sub-selects, as in [`by_chain`]).
fn covering_whole() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "SELECT {COMPACTION_COLUMNS} FROM compactions
             WHERE tenant = (SELECT $1::text)
                   AND (covered_chain = ANY((SELECT $2::bytea[])::bytea[]) AND NOT observed
                        OR id = (SELECT $3::text))
             ORDER BY covered_len DESC, created_ms DESC LIMIT 1"
        )
    })
}

/// The statement of [`crate::store::Reads::compaction_covering`]: a row for
/// [`stored_compaction`] (`$2` uncounted by the planner, as in
/// [`by_chain`]).
const COVERING: &str = "SELECT id, tenant, conversation_id, covered_len, covered_chain, created_ms,
        observed
 FROM compactions
 WHERE tenant = $1 AND covered_chain = ANY((SELECT $2::bytea[])::bytea[]) AND NOT observed
 ORDER BY covered_len DESC, created_ms DESC LIMIT 1";

/// The lookups of [`Postgres::look_up`] that are asked, sent together.
async fn look_up(
    pool: &Pool,
    tenant: &str,
    prefix: Option<Vec<Vec<u8>>>,
    covering: Option<Vec<Vec<u8>>>,
    body_of: Option<String>,
    goes_on: Option<String>,
) -> Result<Found, StoreError> {
    let client = pool.get().await?;
    let prepare = |sql: &'static str, asked: bool| {
        let client = &client;
        async move {
            match asked {
                true => client.prepare_cached(sql).await.map(Some),
                false => Ok(None),
            }
        }
    };
    // Prepared once per connection (together, the first time).
    let (by_chain, covers) = tokio::join!(
        prepare(by_chain(), prefix.is_some()),
        prepare(covering_whole(), covering.is_some())
    );
    let (by_chain, covers) = (by_chain?, covers?);
    let rows = async {
        match (&by_chain, &prefix) {
            (Some(stmt), Some(chains)) => {
                let (earlier, near) = chains.split_at(chains.len().saturating_sub(NEAR_CHAINS));
                client
                    .query(stmt, &[&tenant, &near, &earlier, &goes_on])
                    .await
            }
            _ => Ok(Vec::new()),
        }
    };
    let row = async {
        match (&covers, &covering) {
            (Some(stmt), Some(chains)) => {
                client.query_opt(stmt, &[&tenant, chains, &body_of]).await
            }
            _ => Ok(None),
        }
    };
    // Both are sent on the first poll, before either answer is awaited.
    let (rows, row) = tokio::join!(rows, row);
    let compaction = match row? {
        Some(r) => Some(crate::store::rows::compaction(&plain(&r)?)?),
        None => None,
    };
    Ok(Found {
        chain: best_hit(&rows?),
        compaction,
        answered: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_announcement_reads_as_the_compaction_it_tells_of() {
        let chain = [7u8; 32];
        let payload = format!(
            "0123abcd cmp_1 12 {} 1700000000000 conv_x",
            blake3::Hash::from_bytes(chain).to_hex()
        );
        let c = Postgres::announced(&payload).expect("announced");
        assert_eq!(
            (c.tenant.as_str(), c.id.as_str(), c.conversation.as_str()),
            ("0123abcd", "cmp_1", "conv_x")
        );
        assert_eq!((c.covered_len, c.covered_chain), (12, chain));
        assert_eq!((c.created_ms, c.observed), (1_700_000_000_000, false));
        // Anything else is not one.
        for bad in [
            "",
            "t cmp_1 12",
            "t cmp_1 x 00 1 conv",
            &payload.replace(" 12 ", " -1 "),
        ] {
            assert!(Postgres::announced(bad).is_none(), "{bad}");
        }
    }
}
