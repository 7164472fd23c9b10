//! The request path's look-up of what other replicas recorded: the longest
//! recorded prefix of a request (by the chains of its items) and the
//! compaction covering the most of it, in one round trip; a request that
//! goes on from this replica's own answer asks the branch probes first.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use deadpool_postgres::Pool;

use super::pool::Postgres;
use super::probes::BranchProbes;
use super::rows::plain;
use super::text::escape;
use crate::store::error::StoreError;
use crate::store::records::{ChainHit, PrefixRef};
use crate::store::rows::{compaction, COMPACTION_COLUMNS};
use crate::store::traits::{Found, LookUp, ReadFuture};
use crate::wire::ItemHash;

/// The request path's reads of what other replicas recorded, awaited
/// rather than waited for: the longest recorded prefix of a request and
/// the compaction covering the most of it, asked together in one round
/// trip (the two statements are sent before either answer is awaited) on
/// the backend's runtime, so that no request's worker blocks.
impl Postgres {
    /// Round trips the request path's reads of the database made
    /// (`compactor_store_reads_total`): a [`crate::store::Reads::look_up`]'s
    /// statements one, whatever they ask; a batch of branch probes one,
    /// however many requests it answers; each other read of
    /// [`super::PostgresReads`] one.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    pub(super) fn counted(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// [`crate::store::Reads::look_up`], run on the backend's runtime.
    ///
    /// A request that goes on from this replica's own answer, asking for no
    /// compaction, asks only whether an exchange left its conversation, in
    /// one round trip with the other requests asking that meanwhile
    /// ([`BranchProbes`]); only if one did are its chains probed, in a
    /// second.
    pub(super) fn look_up(
        &self,
        tenant: &str,
        chains: &[ItemHash],
        ask: LookUp,
    ) -> ReadFuture<Found> {
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
        let probes = self.branches.get_or_init(|| {
            BranchProbes::start(
                &self.handle,
                self.pool.clone(),
                self.timeout,
                self.reads.clone(),
            )
        });
        probes.ask(tenant, escape(conversation).into_owned())
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
        Some(r) => Some(compaction(&plain(&r)?)?),
        None => None,
    };
    Ok(Found {
        chain: best_hit(&rows?),
        compaction,
        answered: true,
    })
}
