//! The pool, its runtime and the database's health.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, QueueMode, RecyclingMethod};
use tokio_postgres::NoTls;

use crate::config::StoreConfig;
use crate::store::error::StoreError;
use crate::store::writer::SharedDatabase;

use super::probes::BranchProbes;
use super::schema::{applied_version, latest_version, migrate};

/// Exchange ids one `nextval` reserves for a process: ids stay unique
/// across replicas with one round trip per this many exchanges.
const ID_BLOCK: i64 = 1024;

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Threads of the backend's runtime: the driver's work is I/O, the callers
/// wait on their own threads.
const RUNTIME_THREADS: usize = 2;

/// How to reach the database.
#[derive(Clone)]
pub struct Options {
    /// `postgres://…`
    pub url: String,
    /// From the URL, `PGPASSWORD` or `password_env` (never logged).
    pub password: Option<String>,
    /// Most connections the pool keeps.
    pub pool_size: usize,
    /// Statement timeout, and the longest wait for a pooled connection.
    pub statement_timeout: Duration,
    /// A commit under way longer than this declares the database stalled.
    pub stall_after: Duration,
    /// How long a claim on computing a conversation's compaction lasts.
    pub claim_lapse: Duration,
    /// The sessions' `synchronous_commit` (`on` unless set).
    pub synchronous_commit: Option<String>,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("stall_after", &self.stall_after)
            .finish_non_exhaustive()
    }
}

impl Options {
    /// The options `[store]` gives.
    pub fn from_config(c: &StoreConfig) -> Self {
        Options {
            url: c.url.clone(),
            password: c.password(),
            pool_size: c.pool_size,
            statement_timeout: Duration::from_millis(c.statement_timeout_ms),
            stall_after: Duration::from_millis(c.stall_after_ms),
            claim_lapse: Duration::from_secs(c.claim_lapse_secs),
            synchronous_commit: Some(c.synchronous_commit.clone()),
        }
    }

    pub(super) fn pg_config(&self) -> Result<tokio_postgres::Config, StoreError> {
        let mut pg: tokio_postgres::Config = self.url.parse().map_err(StoreError::Postgres)?;
        if let Some(p) = &self.password {
            pg.password(p);
        }
        pg.connect_timeout(CONNECT_TIMEOUT);
        pg.application_name("compactor");
        let mut options = format!(
            "-c statement_timeout={}",
            self.statement_timeout.as_millis()
        );
        // Checked against the values PostgreSQL takes (config validation):
        // nothing else reaches the options string.
        if let Some(sync) = self
            .synchronous_commit
            .as_deref()
            .filter(|s| crate::config::SYNCHRONOUS_COMMIT.contains(s))
        {
            options.push_str(&format!(" -c synchronous_commit={sync}"));
        }
        pg.options(options);
        Ok(pg)
    }
}

/// Where the schema of a database stands, for `--check-config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaStatus {
    /// The newest migration applied (0: none).
    pub applied: i32,
    /// The newest this build knows.
    pub latest: i32,
}

impl SchemaStatus {
    /// Whether the database has every migration this build knows.
    pub fn is_current(&self) -> bool {
        self.applied >= self.latest
    }
}

/// A connection pool and the runtime its connections live on, shared by
/// the backend, its reads and the exchange ids.
pub struct Postgres {
    runtime: Option<tokio::runtime::Runtime>,
    pub(super) handle: tokio::runtime::Handle,
    pub(super) pool: Pool,
    pub(super) timeout: Duration,
    pub(super) health: Arc<Health>,
    stall_after: Duration,
    pub(super) claim_lapse: Duration,
    /// Round trips the reads made (see [`Postgres::reads`]).
    pub(super) reads: Arc<std::sync::atomic::AtomicU64>,
    /// Where the look-ups of requests that go on from this replica's own
    /// answer ask whether their conversation branched (started on first
    /// use; see [`reads::BranchProbes`]).
    pub(super) branches: std::sync::OnceLock<BranchProbes>,
    /// Exchanges this process committed (see [`Postgres::wrote`]).
    written: AtomicU64,
}

/// How many exchanges a process commits before it checks that the
/// database's statistics know `exchanges` is no longer empty (see
/// [`Postgres::wrote`]).
const STATISTICS_AT: [u64; 2] = [1_000, 20_000];

/// What tells a stalled database, kept by the writer's commits and read by
/// the request path without a round trip.
#[derive(Default)]
pub(super) struct Health {
    /// Unix ms the commit under way started (0: none is).
    pub(super) busy_since_ms: AtomicI64,
    /// The last commit failed for want of the database (not for a value it
    /// refused); cleared by the next commit that succeeds.
    failing: AtomicBool,
    /// A probe commit is being tried (see [`Postgres::probe_until_up`]).
    probing: AtomicBool,
}

/// How often a database whose last commit failed is tried again with an
/// empty commit, while no request is let through to commit one.
const PROBE_EVERY: Duration = Duration::from_millis(250);

impl Drop for Postgres {
    fn drop(&mut self) {
        // Dropped on an async thread too (the state of a server that
        // stops): a runtime may only be shut down there without blocking.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Postgres {
    /// The pool (no connection yet).
    pub fn new(opts: &Options) -> Result<Arc<Self>, StoreError> {
        // What can be refused is checked before the runtime exists: a
        // runtime dropped on an early return from inside the caller's async
        // context (`serve` opens the store there) would panic.
        let manager = Manager::from_config(
            opts.pg_config()?,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        // The connection used last goes out first: under a light load a
        // few connections serve every call, and their backends (caches,
        // prepared statements' plans) stay warm; a statement's first calls
        // on a connection are planned anew each (see `reads::by_chain`).
        let pool = Pool::builder(manager)
            .queue_mode(QueueMode::Lifo)
            .max_size(opts.pool_size)
            .wait_timeout(Some(opts.statement_timeout))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::Pool(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("compactor-pg")
            .enable_all()
            .build()?;
        Ok(Arc::new(Postgres {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            pool,
            timeout: opts.statement_timeout + CONNECT_TIMEOUT,
            health: Arc::default(),
            stall_after: opts.stall_after,
            claim_lapse: opts.claim_lapse,
            reads: Default::default(),
            branches: Default::default(),
            written: AtomicU64::new(0),
        }))
    }

    /// Connects and applies the migrations the database lacks.
    pub fn open(opts: &Options) -> Result<Arc<Self>, StoreError> {
        let pg = Self::new(opts)?;
        let pool = pg.pool.clone();
        pg.wait(async move { migrate(&pool).await })?;
        Ok(pg)
    }

    /// Where the database's schema stands, without changing it.
    pub fn status(&self) -> Result<SchemaStatus, StoreError> {
        let pool = self.pool.clone();
        self.wait(async move {
            let client = pool.get().await?;
            Ok(SchemaStatus {
                applied: applied_version(&client).await?,
                latest: latest_version(),
            })
        })
    }

    /// Whether the database answers now.
    pub fn ping(&self) -> Result<(), StoreError> {
        let pool = self.pool.clone();
        self.wait(async move {
            pool.get().await?.simple_query("SELECT 1").await?;
            Ok(())
        })
    }

    /// The pool's connections: (open, idle, callers waiting for one).
    pub fn pool_status(&self) -> (usize, usize, usize) {
        let s = self.pool.status();
        (s.size, s.available, s.waiting)
    }

    /// Runs `fut` on the backend's runtime and waits for it, bounded in
    /// time, from any thread: an async caller's thread blocks as on an
    /// SQLite read.
    pub(super) fn wait<T, F>(&self, fut: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let timeout = self.timeout;
        let bounded = async move {
            tokio::time::timeout(timeout, fut)
                .await
                .unwrap_or(Err(StoreError::Timeout))
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return self.handle.block_on(bounded);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(bounded.await);
        });
        let wait = || rx.recv().map_err(|_| StoreError::Closed)?;
        // Called from a request's task: the round trip must not stall the
        // other tasks of that worker, so they move to another thread while
        // this one waits (a current-thread runtime cannot, and just waits).
        match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(wait),
            _ => wait(),
        }
    }

    /// Notes how the commit under way ended: a failure for want of the
    /// database stalls the store until a probe commit succeeds.
    pub(super) fn committed(&self, result: &Result<(), StoreError>) {
        self.health.busy_since_ms.store(0, Ordering::Release);
        let down = result.as_ref().is_err_and(|e| !e.is_refusal());
        self.health.failing.store(down, Ordering::Release);
        if down {
            self.probe_until_up();
        }
    }

    /// Counts `exchanges` more committed. At each of [`STATISTICS_AT`], if
    /// the database's statistics say `exchanges` holds less than half of
    /// what this process alone committed, analyzes the store's tables, in
    /// the background.
    ///
    /// A store's connections keep the plans of their statements (see
    /// `reads::by_chain`), made from the statistics of the time, until the
    /// tables are analyzed again. A database created empty has the
    /// statistics of an empty table until autovacuum first analyzes it, a
    /// minute or more on, and its plans are sequential scans of
    /// `exchanges`, each look-up slower as the table fills (4.4 ms a call
    /// at 17,000 rows in the bench, 0.33 ms once analyzed).
    pub(super) fn wrote(&self, exchanges: u64) {
        let before = self.written.fetch_add(exchanges, Ordering::Relaxed);
        let Some(&at) = STATISTICS_AT
            .iter()
            .find(|&&at| before < at && before + exchanges >= at)
        else {
            return;
        };
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        self.handle.spawn(async move {
            let analyze = async {
                let client = pool.get().await?;
                let row = client
                    .query_one(
                        "SELECT reltuples::float8 FROM pg_class WHERE oid = 'exchanges'::regclass",
                        &[],
                    )
                    .await?;
                let known: f64 = row.try_get(0)?;
                if known >= at as f64 / 2.0 {
                    return Ok::<_, StoreError>(false);
                }
                client
                    .batch_execute("ANALYZE exchanges, items, conversations, compactions")
                    .await?;
                Ok(true)
            };
            match tokio::time::timeout(timeout * 4, analyze).await {
                Ok(Ok(true)) => tracing::info!(
                    written = at,
                    "analyzed the store's tables: their statistics were of a nearly empty store"
                ),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot analyze the store's tables"),
                Err(_) => tracing::warn!("analyzing the store's tables timed out"),
            }
        });
    }

    /// Tries an empty commit every [`PROBE_EVERY`] until one succeeds,
    /// which clears the failure: requests are refused meanwhile, so none
    /// would commit to tell it. One prober at a time.
    fn probe_until_up(&self) {
        if self.health.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (pool, health, timeout) = (self.pool.clone(), self.health.clone(), self.timeout);
        self.handle.spawn(async move {
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                if !health.failing.load(Ordering::Acquire) {
                    break;
                }
                let probe = async {
                    let client = pool.get().await?;
                    client.batch_execute("BEGIN; COMMIT").await?;
                    Ok::<_, StoreError>(())
                };
                if let Ok(Ok(())) = tokio::time::timeout(timeout, probe).await {
                    tracing::info!("the database answers again: requests are served");
                    health.failing.store(false, Ordering::Release);
                    break;
                }
            }
            health.probing.store(false, Ordering::Release);
        });
    }

    /// How long the writer's commit may take before it gives up (its
    /// pipeline may still land afterwards: see `backend`).
    pub fn commit_timeout(&self) -> Duration {
        self.timeout
    }

    /// A new block of exchange ids, unique across every replica.
    pub fn reserve_ids(&self) -> Result<std::ops::Range<i64>, StoreError> {
        let pool = self.pool.clone();
        self.wait(async move {
            let client = pool.get().await?;
            let row = client
                .query_one("SELECT nextval('exchange_id_blocks')", &[])
                .await?;
            let block: i64 = row.get(0);
            Ok(block * ID_BLOCK..(block + 1) * ID_BLOCK)
        })
    }
}

impl SharedDatabase for Postgres {
    fn reserve_ids(&self) -> Result<std::ops::Range<i64>, StoreError> {
        Postgres::reserve_ids(self)
    }

    fn ping(&self) -> Result<(), StoreError> {
        Postgres::ping(self)
    }

    fn pool_status(&self) -> (usize, usize, usize) {
        Postgres::pool_status(self)
    }

    fn reads(&self) -> u64 {
        Postgres::reads(self)
    }

    fn stalled(&self) -> Option<StoreError> {
        if self.health.failing.load(Ordering::Acquire) {
            return Some(StoreError::Stalled(
                "the last commit failed; waiting for one to succeed".into(),
            ));
        }
        let since = self.health.busy_since_ms.load(Ordering::Acquire);
        let age = crate::ids::now_ms() - since;
        (since > 0 && age >= self.stall_after.as_millis() as i64)
            .then(|| StoreError::Stalled(format!("a commit has been under way for {age} ms")))
    }
}
