//! The CPU work that follows an answer (token estimate, the accounting line,
//! a compaction decision taken from the estimate) runs on one thread of
//! its own rather than on tokio's blocking pool.
//!
//! Under load the blocking pool grows a thread per exchange in flight
//! (dozens at concurrency 32). Each of them then builds its own tokenizer
//! regex caches and allocator heap, and wakes and parks once per job; the
//! regex caches of threads that come and go are reached through a shared,
//! locked pool rather than the owner's fast path. One thread for the
//! process keeps all of that warm and uncontended. The work is short (an
//! item is tokenized once, then cached by hash): one core tokenizes
//! 20-70 MB of new text a second, the more the more of its words were seen
//! before (see `tokens::pieces`), far more than a proxy receives.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() + Send>;

/// How long the thread waits for more jobs before it blocks on the queue.
const GATHER: Duration = Duration::from_millis(1);

/// Jobs the thread may have waiting. A job holds its request's items (up
/// to the whole body), so when more work comes in than the thread gets
/// through, the next jobs run where they are queued instead: the intake
/// slows, memory stays bounded.
const MAX_BACKLOG: u64 = 512;

/// A named thread that runs queued jobs one after another.
pub struct Background {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    counts: Arc<Counts>,
    max_backlog: u64,
}

/// Jobs queued and jobs finished, ever: jobs run in order, so every job
/// queued before a moment is done once `done` reaches `queued` of then.
#[derive(Default)]
struct Counts {
    queued: AtomicU64,
    done: AtomicU64,
}

impl Background {
    /// The process's accounting thread.
    pub fn global() -> &'static Background {
        static GLOBAL: OnceLock<Background> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            Background::start("compactor-account").unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot start the accounting thread: its jobs run where they are queued");
                Background::inline()
            })
        })
    }

    /// No thread: every job runs where it is queued (a backlog of none is
    /// always full).
    fn inline() -> Self {
        Self {
            tx: Mutex::new(None),
            counts: Arc::new(Counts::default()),
            max_backlog: 0,
        }
    }

    /// Starts the thread, named `name`.
    pub fn start(name: &str) -> std::io::Result<Self> {
        Self::start_bounded(name, MAX_BACKLOG)
    }

    fn start_bounded(name: &str, max_backlog: u64) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let counts = Arc::new(Counts::default());
        let done = counts.clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let run = |job: Job| {
                    // A panicking job must not take the thread (and the
                    // count) with it.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("background job panicked");
                    }
                    done.done.fetch_add(1, Ordering::AcqRel);
                };
                while let Ok(job) = rx.recv() {
                    run(job);
                    // Under load, jobs queued while the thread sleeps run
                    // together, instead of each waking the thread (a
                    // context switch per exchange on both sides).
                    loop {
                        while let Ok(job) = rx.try_recv() {
                            run(job);
                        }
                        std::thread::sleep(GATHER);
                        match rx.try_recv() {
                            Ok(job) => run(job),
                            Err(_) => break,
                        }
                    }
                }
            })?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            counts,
            max_backlog,
        })
    }

    /// Queues `job`. It runs inside the caller's tokio runtime context (if
    /// any), so it may spawn tasks. Past `MAX_BACKLOG` jobs waiting, it
    /// runs at once, on the caller's thread (and counts neither as queued
    /// nor as done: it is over when this returns).
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        if self.pending() >= self.max_backlog {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                tracing::error!("background job panicked");
            }
            return;
        }
        let handle = tokio::runtime::Handle::try_current().ok();
        let job: Job = Box::new(move || {
            let _guard = handle.as_ref().map(|h| h.enter());
            job();
        });
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        self.counts.queued.fetch_add(1, Ordering::AcqRel);
        if !matches!(tx.as_ref().map(|tx| tx.send(job)), Some(Ok(()))) {
            // Closed: nothing will run it; it counts as done.
            self.counts.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> u64 {
        let done = self.counts.done.load(Ordering::Acquire);
        self.counts
            .queued
            .load(Ordering::Acquire)
            .saturating_sub(done)
    }

    /// Waits (up to `limit`) until every job queued before the call has
    /// run; jobs queued afterwards (by other servers in the process) do not
    /// hold it up.
    pub fn drained(&self, limit: Duration) -> impl std::future::Future<Output = bool> + '_ {
        let target = self.counts.queued.load(Ordering::Acquire);
        let until = Instant::now() + limit;
        async move {
            while self.counts.done.load(Ordering::Acquire) < target {
                if Instant::now() >= until {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            true
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it is empty.
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_its_thread_every_job_runs_where_it_is_queued() {
        let bg = Background::inline();
        let ran = Arc::new(AtomicU64::new(0));
        for _ in 0..3 {
            let ran = ran.clone();
            bg.spawn(move || {
                ran.fetch_add(1, Ordering::AcqRel);
            });
        }
        assert_eq!(ran.load(Ordering::Acquire), 3);
        assert_eq!(bg.pending(), 0);
    }

    #[tokio::test]
    async fn runs_every_job_in_the_runtime_context() {
        let bg = Background::start("test-background").unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..100u32 {
            let tx = tx.clone();
            bg.spawn(move || {
                // Spawning needs the runtime context the job was queued from.
                tokio::spawn(async move {
                    let _ = tx.send(i);
                });
            });
        }
        drop(tx);
        let mut seen = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(i) = rx.recv().await {
                seen.push(i);
            }
        })
        .await
        .expect("all jobs ran");
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        assert!(bg.drained(Duration::from_secs(5)).await);
        assert_eq!(bg.pending(), 0);
    }

    #[tokio::test]
    async fn draining_waits_for_what_was_queued_before_only() {
        let bg = Background::start("test-background").unwrap();
        // Jobs that hold the thread until the test lets them go.
        let gate = |rx: Arc<Mutex<std::sync::mpsc::Receiver<()>>>| {
            move || {
                let _ = rx.lock().unwrap().recv_timeout(Duration::from_secs(10));
            }
        };
        let (release_first, first) = std::sync::mpsc::channel::<()>();
        bg.spawn(gate(Arc::new(Mutex::new(first))));
        assert!(
            !bg.drained(Duration::from_millis(50)).await,
            "the first job waits"
        );
        let drain = bg.drained(Duration::from_secs(10));
        let (release_later, later) = std::sync::mpsc::channel::<()>();
        let later = Arc::new(Mutex::new(later));
        for _ in 0..3 {
            bg.spawn(gate(later.clone()));
        }
        release_first.send(()).unwrap();
        // Done once the first job is, though three wait behind it.
        assert!(drain.await);
        assert_eq!(bg.pending(), 3);
        assert!(!bg.drained(Duration::from_millis(50)).await);
        for _ in 0..3 {
            release_later.send(()).unwrap();
        }
        assert!(bg.drained(Duration::from_secs(10)).await);
        assert_eq!(bg.pending(), 0);
    }

    #[tokio::test]
    async fn a_job_past_the_backlog_runs_where_it_is_queued() {
        let bg = Background::start_bounded("test-background", 2).unwrap();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        // Two jobs fill the backlog; the first holds the thread.
        for _ in 0..2 {
            let gate = gate.clone();
            bg.spawn(move || {
                let _ = gate.lock().unwrap().recv_timeout(Duration::from_secs(10));
            });
        }
        let ran_on = Arc::new(Mutex::new(None));
        let ran = ran_on.clone();
        bg.spawn(move || *ran.lock().unwrap() = Some(std::thread::current().id()));
        assert_eq!(
            *ran_on.lock().unwrap(),
            Some(std::thread::current().id()),
            "ran before spawn returned, on the caller's thread"
        );
        assert_eq!(bg.pending(), 2);
        for _ in 0..2 {
            release.send(()).unwrap();
        }
        assert!(bg.drained(Duration::from_secs(10)).await);
        assert_eq!(bg.pending(), 0);
    }

    #[tokio::test]
    async fn a_panicking_job_does_not_stop_the_rest() {
        let bg = Background::start("test-background").unwrap();
        bg.spawn(|| panic!("boom"));
        let (tx, rx) = std::sync::mpsc::channel();
        bg.spawn(move || tx.send(7).unwrap());
        let got = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(10)))
            .await
            .unwrap();
        assert_eq!(got, Ok(7));
        assert!(bg.drained(Duration::from_secs(5)).await);
    }
}
