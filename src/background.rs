//! The CPU work that follows an answer (token estimate, the accounting line,
//! a compaction decision taken from the estimate) runs on a few threads of
//! its own rather than on tokio's blocking pool.
//!
//! Under load the blocking pool grows a thread per exchange in flight
//! (dozens at concurrency 32). Each of them then builds its own tokenizer
//! regex caches and allocator heap, and wakes and parks once per job; the
//! regex caches of threads that come and go are reached through a shared,
//! locked pool rather than the owner's fast path. One thread for the
//! process keeps all of that warm and uncontended. The work is short (an
//! item is tokenized once, then cached by hash): one core tokenizes about
//! 25 MB of new text a second, far more than a proxy receives.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() + Send>;

/// A small pool of named threads fed by one queue.
pub struct Background {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    pending: Arc<AtomicUsize>,
}

impl Background {
    /// The process's accounting thread.
    pub fn global() -> &'static Background {
        static GLOBAL: OnceLock<Background> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            Background::start("compactor-account", 1).expect("cannot start the accounting thread")
        })
    }

    /// Starts `threads` threads (at least one) named `name`.
    pub fn start(name: &str, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let pending = Arc::new(AtomicUsize::new(0));
        for _ in 0..threads.max(1) {
            let (rx, pending) = (rx.clone(), pending.clone());
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok(job) = job else { return };
                    // A panicking job must not take the thread (and the
                    // count) with it.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("background job panicked");
                    }
                    pending.fetch_sub(1, Ordering::AcqRel);
                })?;
        }
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            pending,
        })
    }

    /// Queues `job`. It runs inside the caller's tokio runtime context (if
    /// any), so it may spawn tasks.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        let handle = tokio::runtime::Handle::try_current().ok();
        let job: Job = Box::new(move || {
            let _guard = handle.as_ref().map(|h| h.enter());
            job();
        });
        self.pending.fetch_add(1, Ordering::AcqRel);
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Err(_)) = tx.as_ref().map(|tx| tx.send(job)) {
            self.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// Waits (up to `limit`) until every queued job has run.
    pub async fn drained(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while self.pending() > 0 {
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // Closing the queue ends the threads once it is empty.
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_every_job_in_the_runtime_context() {
        let bg = Background::start("test-background", 2).unwrap();
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
    async fn a_panicking_job_does_not_stop_the_rest() {
        let bg = Background::start("test-background", 1).unwrap();
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
