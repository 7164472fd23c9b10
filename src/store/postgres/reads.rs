//! The PostgreSQL store's point reads: how every replica finds what another
//! recorded (the look-up by chains is in `lookup`).

use std::future::Future;
use std::sync::Arc;

use deadpool_postgres::Pool;

use super::pool::{Options, Postgres};
use super::rows::{plain, stored_compaction};
use super::text::{escape, escape_opt, unescape, unescape_opt};
use crate::compaction::Compaction;
use crate::store::error::StoreError;
use crate::store::records::{AttemptRecord, StoredCompaction};
use crate::store::rows::{compaction, rebuild_items, unpack_hashes, Link, COMPACTION_COLUMNS};
use crate::store::traits::{Found, LookUp, ReadFuture, Reads};
use crate::wire::ItemHash;

/// The point reads of a PostgreSQL store, and the lookups that let every
/// replica find what another recorded.
pub struct PostgresReads {
    pg: Arc<Postgres>,
    /// Names this process in compaction claims.
    owner: String,
    /// The manual compactions this process heard are pending.
    manual: super::listen::Heard,
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

impl Reads for PostgresReads {
    fn compaction(&self, id: &str) -> Option<Compaction> {
        let id = id.to_string();
        self.read("compaction", |pool| async move {
            let client = pool.get().await?;
            let sql = format!("SELECT {COMPACTION_COLUMNS} FROM compactions WHERE id = $1");
            let stmt = client.prepare_cached(&sql).await?;
            match client.query_opt(&stmt, &[&id]).await? {
                Some(r) => Ok(Some(compaction(&plain(&r)?)?)),
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
        // The lapse runs on the database's clock, the one clock every
        // replica reads alike.
        let claimed = self.read("claim", |pool| async move {
            let client = pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "INSERT INTO compaction_claims (tenant, conversation_id, owner, expires_ms)
                     VALUES ($1, $2, $3, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint + $4)
                     ON CONFLICT (tenant, conversation_id) DO UPDATE
                         SET owner = excluded.owner, expires_ms = excluded.expires_ms
                         WHERE compaction_claims.expires_ms
                             < (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint
                     RETURNING owner",
                )
                .await?;
            let row = client
                .query_opt(&stmt, &[&tenant, &conversation, &owner, &for_ms])
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
            super::listen::request(&mut client, &owned).await
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
            super::listen::pending(&client, &conversation).await
        })
    }

    fn manual_heard(&self, conversation: &str) -> bool {
        self.manual.contains(conversation)
    }

    fn take_manual(&self, tenant: &str, conversation: &str) -> bool {
        let (tenant, owned) = (tenant.to_string(), conversation.to_string());
        let taken = self.read("take_manual", |pool| async move {
            let client = pool.get().await?;
            super::listen::take(&client, &tenant, &owned)
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
    let links: Vec<Link> = rows
        .iter()
        .map(|r| {
            (
                r.get::<_, Option<i64>>(0),
                r.get::<_, i64>(1) as usize,
                r.get(2),
                unpack_hashes(r.get(3)),
                unpack_hashes(r.get(4)),
            )
        })
        .collect();
    let Some(last) = links.last() else {
        return Ok(None);
    };
    let response = last.4.clone();
    let mut hashes = rebuild_items(links);
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
    /// asked (see `listen`): returns once the pending ones
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

/// The statement of [`crate::store::Reads::compaction_covering`]: a row for
/// [`stored_compaction`] (`$2` uncounted by the planner, as in
/// [`by_chain`]).
const COVERING: &str = "SELECT id, tenant, conversation_id, covered_len, covered_chain, created_ms,
        observed
 FROM compactions
 WHERE tenant = $1 AND covered_chain = ANY((SELECT $2::bytea[])::bytea[]) AND NOT observed
 ORDER BY covered_len DESC, created_ms DESC LIMIT 1";

/// Every compaction stored is announced on [`super::listen::COMPACTED`] by
/// a trigger, so that a replica that hears them all asks for a
/// conversation's compactions only once.
impl Postgres {
    /// The compaction a [`super::listen::COMPACTED`] announcement
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
