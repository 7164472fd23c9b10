//! The branch probes: whether an exchange left a conversation, asked for
//! the requests that go on from this replica's own answer, one statement
//! for all the requests that asked meanwhile.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use crate::store::error::StoreError;

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

impl BranchProbes {
    /// The queue, and the task on `runtime` that answers it.
    pub(super) fn start(
        runtime: &tokio::runtime::Handle,
        pool: Pool,
        timeout: Duration,
        reads: Arc<AtomicU64>,
    ) -> Self {
        let (probes, asked) = tokio::sync::mpsc::unbounded_channel();
        runtime.spawn(probe_branches(asked, pool, timeout, reads));
        BranchProbes(probes)
    }

    /// Whether an exchange of `tenant` left `conversation` (escaped as
    /// stored), asked with the other probes waiting.
    pub(super) fn ask(
        &self,
        tenant: &str,
        conversation: String,
    ) -> tokio::sync::oneshot::Receiver<Result<bool, Arc<StoreError>>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // A closed loop (the runtime shutting down) drops `tx`: the
        // receiver then reads as a failed read.
        let _ = self.0.send(Probe {
            tenant: tenant.to_string(),
            conversation,
            answer: tx,
        });
        rx
    }
}

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
    timeout: Duration,
    reads: Arc<AtomicU64>,
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
