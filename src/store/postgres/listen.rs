//! Manual compactions across replicas: a request (the admin API,
//! `compactor compact`) is a row of `manual_compactions`, whichever replica
//! received it, and the replica that serves the conversation's next request
//! takes the row; only one can, so the conversation is compacted once.
//!
//! A request must not cost a round trip to look for a row. Every replica
//! keeps one connection that `LISTEN`s: a row added or taken is announced
//! (`NOTIFY`, delivered at commit), and the replica keeps the set of
//! conversations it heard are pending. Only a request of one of those asks
//! the database, to take the row. At start-up, and after each reconnect,
//! the rows pending are read, so a request made while no replica was up, or
//! while this one was cut off, is not missed.
//!
//! The same connection hears deletions ([`super::retention::FORGET_CHANNEL`]):
//! what another replica or the CLI deleted is forgotten here too (and the
//! items believed stored whenever listening stops or starts again, since
//! a deletion may have gone unheard); and the
//! compactions stored ([`COMPACTED`], see `Postgres::announced`), so that
//! a replica knows every compaction stored while it listens.

use std::future::poll_fn;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_postgres::{AsyncMessage, NoTls};

use crate::store::error::StoreError;
use crate::store::retention::FORGET_CHANNEL as FORGET;

/// A pooled connection.
type Client = deadpool_postgres::Client;

/// The channel rows added (`+conv_…`) and taken (`-conv_…`) are announced on.
pub const CHANNEL: &str = "compactor_manual";

/// The channel every compaction stored is announced on (by a trigger).
pub const COMPACTED: &str = "compactor_compacted";

/// The listening connection's `application_name`, to tell it apart among
/// a replica's connections (`pg_stat_activity`).
pub const APPLICATION_NAME: &str = "compactor-listen";

/// The first wait before connecting again after the listening connection
/// dropped or could not be made; doubled after each failure up to
/// [`RECONNECT_MAX`].
const RECONNECT_MIN: Duration = Duration::from_millis(100);

/// The longest wait between two attempts to listen again.
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The conversations with a pending manual compaction this replica heard
/// of, kept up to date by a listening connection.
#[derive(Default)]
pub struct Heard {
    pending: Arc<Mutex<foldhash::HashSet<String>>>,
    listener: OnceLock<tokio::task::AbortHandle>,
    forget: OnForget,
    compacted: Compacted,
}

/// What to do with a stored compaction's announcement, and whether all
/// are heard.
#[derive(Default, Clone)]
struct Compacted {
    on: OnForget,
    /// Odd while listening, even while not: bumped at each change, so that
    /// a value seen twice means nothing was missed in between.
    epoch: Arc<AtomicU64>,
}

/// What to do with a deletion's announcement (its payload), once the
/// process that forgets has said.
type OnForget = Arc<OnceLock<Box<dyn Fn(&str) + Send + Sync>>>;

impl Drop for Heard {
    fn drop(&mut self) {
        if let Some(task) = self.listener.get() {
            task.abort();
        }
    }
}

impl Heard {
    /// Starts listening on `runtime` (once): the returned receiver fires
    /// once the pending rows are read the first time, or the first attempt
    /// failed (then it goes on trying in the background).
    pub fn listen(
        &self,
        runtime: &tokio::runtime::Handle,
        mut config: tokio_postgres::Config,
    ) -> oneshot::Receiver<()> {
        config.application_name(APPLICATION_NAME);
        let (ready, started) = oneshot::channel();
        if self.listener.get().is_none() {
            let (pending, forget) = (self.pending.clone(), self.forget.clone());
            let compacted = self.compacted.clone();
            let task = runtime.spawn(listen(config, pending, forget, compacted, ready));
            if self.listener.set(task.abort_handle()).is_err() {
                task.abort();
            }
        }
        started
    }

    /// Whether a manual compaction of `conversation` is known pending.
    pub fn contains(&self, conversation: &str) -> bool {
        lock(&self.pending).contains(conversation)
    }

    /// Calls `f` with each deletion announced from now on (once set, kept).
    pub fn on_forget(&self, f: Box<dyn Fn(&str) + Send + Sync>) {
        let _ = self.forget.set(f);
    }

    /// Calls `f` with each compaction's announcement from now on (once
    /// set, kept).
    pub fn on_compacted(&self, f: Box<dyn Fn(&str) + Send + Sync>) {
        let _ = self.compacted.on.set(f);
    }

    /// While listening, a number that changes when listening stops.
    pub fn hearing(&self) -> Option<u64> {
        Some(self.compacted.epoch.load(Ordering::Acquire)).filter(|e| e % 2 == 1)
    }

    /// Knows `conversation` pending without waiting to hear it: what this
    /// replica was asked applies to the next request it serves, which may
    /// come before the announcement is delivered back to it.
    pub fn hear(&self, conversation: &str) {
        lock(&self.pending).insert(conversation.to_string());
    }

    /// Forgets `conversation` (taken, by this replica or another).
    pub fn forget(&self, conversation: &str) {
        lock(&self.pending).remove(conversation);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Listens for as long as the replica runs, connecting again after a
/// failure with a bounded back-off.
async fn listen(
    config: tokio_postgres::Config,
    pending: Arc<Mutex<foldhash::HashSet<String>>>,
    forget: OnForget,
    compacted: Compacted,
    ready: oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    let mut wait = RECONNECT_MIN;
    loop {
        let mut listened = false;
        let ended = session(
            &config,
            &pending,
            &forget,
            &compacted,
            &mut ready,
            &mut listened,
        )
        .await;
        // Compactions stored from now on may go unheard.
        if compacted.epoch.load(Ordering::Acquire) % 2 == 1 {
            compacted.epoch.fetch_add(1, Ordering::AcqRel);
        }
        // And so may deletions: the items believed stored are forgotten,
        // as when one is heard (an empty announcement names none).
        if let Some(forget) = forget.get() {
            forget("");
        }
        // It listened a while: the back-off starts anew.
        if listened {
            wait = RECONNECT_MIN;
        }
        match ended {
            Ok(()) => tracing::warn!("the connection listening for manual compactions closed"),
            Err(e) => tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64,
                "cannot listen for manual compactions"),
        }
        // Start-up goes on without them: a request made meanwhile is read
        // once listening works.
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RECONNECT_MAX);
    }
}

/// One listening connection, until it drops (`Ok` when the server closed
/// it); `listened` is set once it listens.
async fn session(
    config: &tokio_postgres::Config,
    pending: &Arc<Mutex<foldhash::HashSet<String>>>,
    forget: &OnForget,
    compacted: &Compacted,
    ready: &mut Option<oneshot::Sender<()>>,
    listened: &mut bool,
) -> Result<(), StoreError> {
    let (client, mut connection) = config.connect(NoTls).await?;
    let unheard = forget.clone();
    // The connection's messages: replies to the client, and notifications,
    // applied in the order they were committed.
    let (told, forget) = (pending.clone(), forget.clone());
    let stored = compacted.on.clone();
    let mut driver = tokio::spawn(async move {
        while let Some(message) = poll_fn(|cx| connection.poll_message(cx)).await {
            let AsyncMessage::Notification(n) = message? else {
                continue;
            };
            if n.channel() == FORGET {
                if let Some(forget) = forget.get() {
                    forget(n.payload());
                }
            } else if n.channel() == COMPACTED {
                if let Some(stored) = stored.get() {
                    stored(n.payload());
                }
            } else {
                apply(&told, n.payload());
            }
        }
        Ok::<(), tokio_postgres::Error>(())
    });
    let load = async {
        // Listening before reading: a row added meanwhile is either read or
        // heard (both, at worst).
        client
            .batch_execute(&format!(
                "LISTEN {CHANNEL}; LISTEN {FORGET}; LISTEN {COMPACTED}"
            ))
            .await?;
        let rows = client
            .query("SELECT conversation_id FROM manual_compactions", &[])
            .await?;
        let mut known = lock(pending);
        // A row taken while this replica was not listening may stay known:
        // the request that finds it asks the database, and forgets it.
        known.extend(rows.iter().map(|r| r.get::<_, String>(0)));
        Ok::<_, StoreError>(known.len())
    };
    let loaded = tokio::select! {
        loaded = load => loaded?,
        ended = &mut driver => {
            connection_end(ended)?;
            return Err(StoreError::Io(std::io::Error::other(
                "the connection closed before it listened",
            )));
        }
    };
    tracing::debug!(pending = loaded, "listening for manual compactions");
    *listened = true;
    // Listening: every compaction committed from here on is heard.
    compacted.epoch.fetch_add(1, Ordering::AcqRel);
    match ready.take() {
        Some(r) => {
            let _ = r.send(());
        }
        // Listening again: what was deleted meanwhile went unheard, and the
        // items claimed since may be among it.
        None => {
            if let Some(forget) = unheard.get() {
                forget("");
            }
        }
    }
    let ended = driver.await;
    // Kept open until the connection ends.
    drop(client);
    connection_end(ended)
}

/// How the connection's driver ended: `Ok` when the server closed it.
fn connection_end(
    ended: Result<Result<(), tokio_postgres::Error>, tokio::task::JoinError>,
) -> Result<(), StoreError> {
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(StoreError::Postgres(e)),
        Err(e) => Err(StoreError::Io(std::io::Error::other(e.to_string()))),
    }
}

/// Applies one notification: `+conv_…` added, `-conv_…` taken.
fn apply(pending: &Mutex<foldhash::HashSet<String>>, payload: &str) {
    let mut known = lock(pending);
    if let Some(added) = payload.strip_prefix('+') {
        known.insert(added.to_string());
    } else if let Some(taken) = payload.strip_prefix('-') {
        known.remove(taken);
    }
}

/// Records a manual compaction of `conversation` (of the tenant that owns
/// it) and announces it: true if it was not pending yet.
pub async fn request(client: &mut Client, conversation: &str) -> Result<bool, StoreError> {
    let tx = client.transaction().await?;
    let added = tx
        .execute(
            "INSERT INTO manual_compactions (conversation_id, tenant, requested_ms)
             SELECT id, tenant, $2 FROM conversations WHERE id = $1
             ON CONFLICT DO NOTHING",
            &[&conversation, &crate::ids::now_ms()],
        )
        .await?;
    // Announced even when it was pending: a replica that missed the first
    // announcement hears this one.
    tx.execute(
        "SELECT pg_notify($1, $2)",
        &[&CHANNEL, &format!("+{conversation}")],
    )
    .await?;
    tx.commit().await?;
    Ok(added == 1)
}

/// Whether a manual compaction of `conversation` is pending.
pub async fn pending(client: &Client, conversation: &str) -> Result<bool, StoreError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM manual_compactions WHERE conversation_id = $1)",
            &[&conversation],
        )
        .await?;
    Ok(row.get(0))
}

/// Takes the tenant's pending manual compaction of `conversation`, in one
/// statement: of replicas racing for it, one gets the row, and the others
/// hear it was taken.
pub async fn take(client: &Client, tenant: &str, conversation: &str) -> Result<bool, StoreError> {
    let stmt = client
        .prepare_cached(
            "WITH taken AS (
                 DELETE FROM manual_compactions WHERE conversation_id = $1 AND tenant = $2
                 RETURNING conversation_id)
             SELECT pg_notify($3, '-' || conversation_id) FROM taken",
        )
        .await?;
    let rows = client
        .query(&stmt, &[&conversation, &tenant, &CHANNEL])
        .await?;
    Ok(!rows.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_add_and_take_in_order() {
        let pending = Mutex::new(foldhash::HashSet::default());
        apply(&pending, "+conv_a");
        apply(&pending, "+conv_b");
        apply(&pending, "-conv_a");
        apply(&pending, "conv_c");
        let mut known: Vec<String> = lock(&pending).iter().cloned().collect();
        known.sort();
        assert_eq!(known, ["conv_b"]);
        // Taken, then asked for again.
        apply(&pending, "-conv_b");
        apply(&pending, "+conv_b");
        assert!(lock(&pending).contains("conv_b"));
    }
}
