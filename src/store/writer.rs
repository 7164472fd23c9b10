//! The store's handle and its writer thread: exchanges journaled or sent
//! to the thread, committed in batches, acknowledged once committed; the
//! backlog bound, and exchange ids (from blocks of a shared database).

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::error::StoreError;
use super::journal::{self, Journal};
use super::records::{ExchangeRecord, Limits, Record, Snapshot, KNOWN_ITEMS};
use super::traits::Backend;
use crate::bounded::Generations;
use crate::compaction::Compaction;
use crate::wire::ItemHash;

/// Most records the writer commits in one transaction. Each new item
/// lands on a random page of the items' hash index, and a commit writes
/// every page it touched to the WAL: the more items one commit holds, the
/// more of them share pages (at 1,024 rather than 256, a fifth to a third
/// less store thread CPU per exchange in the bench's Codex rows). Under
/// load, [`IMPORT_DELAY`] ends a batch before this does.
const MAX_BATCH: usize = 4096;

/// Told when a commit is done (or failed).
type Ack = Box<dyn FnOnce(Result<(), Arc<StoreError>>) + Send>;

enum Cmd {
    /// A journaled exchange: imported with the next batch.
    Import(Record, u64, usize),
    /// A record to commit now (then acknowledged).
    Write(Record, Option<Ack>),
    /// Commit what is pending now, then acknowledge.
    Flush(Ack),
}

/// Handle to the store: cheap to share, writes through the writer thread.
pub struct Store {
    tx: Mutex<mpsc::Sender<Cmd>>,
    /// The writer thread, woken for what must be committed now.
    writer: std::thread::Thread,
    /// Items stored (or on their way), the recent ones: a request's items
    /// found here go without their bodies. One not found (new, or not seen
    /// for long) goes with its body, which the database ignores if it has it.
    known: Mutex<Generations<ItemHash, ()>>,
    /// How many times `known` was forgotten (see [`Store::forgets`]).
    forgets: Arc<AtomicU64>,
    backlog: Arc<Backlog>,
    max_backlog: usize,
    next_id: AtomicI64,
    /// Where ids come from when other processes write the same store.
    ids: Option<SharedIds>,
    /// Told how long each commit took (the writer thread calls it).
    commits: Arc<std::sync::OnceLock<CommitObserver>>,
    journal: Option<Arc<Journal>>,
}

/// Told how long a commit took.
pub type CommitObserver = Box<dyn Fn(Duration) + Send + Sync>;

/// The database of a store other processes write too, as the request path
/// sees it.
pub trait SharedDatabase: Send + Sync + 'static {
    /// Reserves a block of exchange ids no other process gets.
    fn reserve_ids(&self) -> Result<std::ops::Range<i64>, StoreError>;
    /// Why the database cannot take a commit now, if it cannot: a commit
    /// has been under way longer than the stall bound, or the last one
    /// failed for want of the database and none has succeeded since.
    /// Answered from memory.
    fn stalled(&self) -> Option<StoreError>;
    /// Whether the database answers now (a round trip).
    fn ping(&self) -> Result<(), StoreError>;
    /// The pool's connections: (open, idle, callers waiting for one).
    fn pool_status(&self) -> (usize, usize, usize);
    /// Round trips the request path's reads of the database made since
    /// start (`compactor_store_reads_total`).
    fn reads(&self) -> u64;
}

/// Exchange ids of a store shared with other processes: taken from blocks
/// reserved in the database, one round trip per block.
struct SharedIds {
    db: Arc<dyn SharedDatabase>,
    block: Mutex<std::ops::Range<i64>>,
}

/// Where [`Store::stage`] put a record.
enum Journaled<'a> {
    /// Staged in this journal at this sequence number.
    At(&'a Journal, u64),
    /// Not journaled: to be committed.
    Back(Box<ExchangeRecord>),
}

/// How long a journaled exchange may wait for its import: long enough to
/// import in large batches under load (see [`MAX_BATCH`]; at 500 rather
/// than 200 ms, a third less store thread CPU per exchange in the bench's
/// 30 KB Codex rows, some 2,700 records a commit instead of 1,024), short
/// enough that a reader in another process sees it within half a second.
const IMPORT_DELAY: Duration = Duration::from_millis(500);

/// How often a journaled batch a shared database failed to take is tried
/// again (with what was journaled since).
const RETRY_EVERY: Duration = Duration::from_millis(250);

/// How the writer treats journaled exchanges.
#[derive(Clone, Copy, Default)]
struct Imports {
    /// How long one may wait for its import (see [`IMPORT_DELAY`]).
    delay: Duration,
    /// A failed import is tried again until it lands (a shared database,
    /// which may be down for a while), rather than left to the next
    /// start-up.
    retry: bool,
}

impl Store {
    /// Starts the writer thread over `backend` and returns the handle plus
    /// what was loaded. With a journal (opened with the records an earlier
    /// run left in it), exchanges are journaled and imported in batches;
    /// the leftovers are imported before anything is loaded.
    pub fn start(
        backend: Box<dyn Backend>,
        journal: Option<(Journal, Vec<ExchangeRecord>)>,
        limits: Limits,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        Self::start_bounded(backend, journal, limits, MAX_BACKLOG_BYTES)
    }

    /// [`Store::start`] for a store other processes write too: exchange ids
    /// from `db`, and requests refused while `db` is stalled. Without a
    /// journal an exchange is committed before its answer is released.
    /// With one (a local file of this process) its answer goes once it is
    /// journaled; the writer commits what was journaled `commit_delay`
    /// after the first of it at the latest, with what was journaled
    /// meanwhile (the other replicas see it then), at once when a record
    /// that must be committed before its answer comes; and a commit that
    /// failed is tried again until it lands, never recorded as withheld.
    pub fn start_shared(
        backend: Box<dyn Backend>,
        db: Arc<dyn SharedDatabase>,
        journal: Option<(Journal, Vec<ExchangeRecord>)>,
        limits: Limits,
        commit_delay: Duration,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        let imports = Imports {
            delay: commit_delay,
            retry: true,
        };
        let (store, snapshot) =
            Self::start_with(backend, journal, limits, MAX_BACKLOG_BYTES, imports)?;
        let mut store = Arc::into_inner(store).ok_or(StoreError::Closed)?;
        store.ids = Some(SharedIds {
            db,
            block: Mutex::new(0..0),
        });
        Ok((Arc::new(store), snapshot))
    }

    /// [`Store::start`] with the backlog bound given (see
    /// [`MAX_BACKLOG_BYTES`]).
    pub(crate) fn start_bounded(
        backend: Box<dyn Backend>,
        journal: Option<(Journal, Vec<ExchangeRecord>)>,
        limits: Limits,
        max_backlog: usize,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        let imports = Imports {
            delay: IMPORT_DELAY,
            retry: false,
        };
        Self::start_with(backend, journal, limits, max_backlog, imports)
    }

    fn start_with(
        mut backend: Box<dyn Backend>,
        journal: Option<(Journal, Vec<ExchangeRecord>)>,
        limits: Limits,
        max_backlog: usize,
        imports: Imports,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        let journal = match journal {
            Some((journal, leftovers)) => {
                if !leftovers.is_empty() {
                    tracing::info!(
                        records = leftovers.len(),
                        "importing exchanges journaled before the last stop"
                    );
                    // On a thread of its own: a backend may block on a
                    // runtime of its own, which the caller's async context
                    // (`serve` opens the store there) must not do.
                    let records = journal::exchanges(leftovers);
                    std::thread::scope(|s| {
                        s.spawn(|| backend.write(&records))
                            .join()
                            .unwrap_or_else(|_| Err(StoreError::Closed))
                    })?;
                }
                journal.leftovers_imported()?;
                Some(Arc::new(journal))
            }
            None => None,
        };
        let snapshot = backend.load(limits)?;
        let (tx, rx) = mpsc::channel::<Cmd>();
        let upkeep = journal.clone();
        let backlog = Arc::new(Backlog::default());
        let drained = backlog.clone();
        let commits: Arc<std::sync::OnceLock<CommitObserver>> = Arc::default();
        let observer = commits.clone();
        let forgets: Arc<AtomicU64> = Arc::default();
        let forgotten = forgets.clone();
        let writer = std::thread::Builder::new()
            .name("compactor-store".into())
            .spawn(move || writer_loop(backend, rx, upkeep, drained, observer, forgotten, imports))?
            .thread()
            .clone();
        let store = Store {
            tx: Mutex::new(tx),
            writer,
            known: Mutex::new({
                let mut known = Generations::new(KNOWN_ITEMS);
                for &h in &snapshot.item_hashes {
                    known.insert(h, ());
                }
                known
            }),
            forgets,
            next_id: AtomicI64::new(snapshot.max_exchange_id + 1),
            ids: None,
            commits,
            backlog,
            max_backlog,
            journal,
        };
        Ok((Arc::new(store), snapshot))
    }

    /// Whether other processes write the same store (then an answer whose
    /// exchange could not be committed must not reach its client).
    pub fn is_shared(&self) -> bool {
        self.ids.is_some()
    }

    /// Whether the store takes an exchange now: an error while a shared
    /// store's database is stalled or down ([`SharedDatabase::stalled`]),
    /// told without asking the database. A request refused here goes
    /// nowhere, so no answer is billed and then withheld.
    pub fn available(&self) -> Result<(), StoreError> {
        match self.ids.as_ref().and_then(|ids| ids.db.stalled()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Has `observe` told the duration of every commit from now on (the
    /// first observer set stays).
    pub fn observe_commits(&self, observe: CommitObserver) {
        let _ = self.commits.set(observe);
    }

    /// A fresh exchange id. Fails only for a shared store whose database
    /// cannot be reached for a new block of ids.
    pub fn next_exchange_id(&self) -> Result<i64, StoreError> {
        let Some(ids) = &self.ids else {
            return Ok(self.next_id.fetch_add(1, Ordering::Relaxed));
        };
        // While the database is stalled (or down) a request is refused at
        // once, before it goes upstream: none waits for it in turn.
        self.available()?;
        let mut block = ids.block.lock().unwrap_or_else(|p| p.into_inner());
        if block.is_empty() {
            *block = ids.db.reserve_ids()?;
        }
        let id = block.start;
        block.start += 1;
        Ok(id)
    }

    /// Forgets which items are stored: after items were deleted, every
    /// record sends its items' bodies again until it is known anew, and so
    /// do the records claimed before that are not committed yet (see
    /// [`Store::forgets`]).
    pub fn forget_known_items(&self) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        *known = Generations::new(KNOWN_ITEMS);
        // Under the lock: a claim that saw the items known saw the count
        // before this.
        self.forgets.fetch_add(1, Ordering::AcqRel);
    }

    /// How many times the items believed stored were forgotten. A record
    /// takes it before claiming its items ([`ExchangeRecord::claimed_at`]);
    /// when it has changed by the time the writer commits the record, the
    /// record goes with the bodies it left out too
    /// ([`ExchangeRecord::stored_items`]): the deletion that made the
    /// process forget may have taken those items meanwhile.
    pub fn forgets(&self) -> u64 {
        self.forgets.load(Ordering::Acquire)
    }

    /// Marks `hash` as stored (or about to be); true if it was not yet.
    pub fn claim_item(&self, hash: &ItemHash) -> bool {
        self.claim_items(std::slice::from_ref(hash))
            .next()
            .is_some()
    }

    /// [`Store::claim_item`] for several, under one lock: the positions of
    /// those that were not yet stored.
    pub fn claim_items<'a>(&self, hashes: &'a [ItemHash]) -> impl Iterator<Item = usize> + 'a {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let fresh: Vec<usize> = (0..hashes.len())
            .filter(|&i| known.insert(hashes[i], ()).is_none())
            .collect();
        fresh.into_iter()
    }

    /// Records an exchange durably: once this returns `Ok`, the exchange
    /// survives the process being killed. Journaled (one write) when the
    /// store has a journal, else committed.
    ///
    /// On a store other replicas share, an exchange the next turn must
    /// find by itself is committed too before this returns: its client may
    /// send that turn to another replica the moment it is answered, which
    /// finds it only in the database. That is a conversation's first
    /// exchange (else another conversation would start) and one whose
    /// client chains answers by id (else the next turn's
    /// `previous_response_id` would not be expanded), and one that left the
    /// conversation of its longest recorded prefix (a branch: else another
    /// replica would go on in the conversation it left, unread). Other exchanges need
    /// no such wait: the replica serving the next turn finds the
    /// conversation by any one of them (see
    /// `ConversationIndex::identify_with`).
    pub async fn record(&self, rec: ExchangeRecord) -> Result<(), StoreError> {
        let streamed = rec.streamed;
        let visible_before_answer =
            (rec.new_conversation || rec.chained_by_id || rec.branched_from.is_some())
                && self.ids.is_some();
        match self.stage(rec)? {
            Journaled::At(journal, seq) => {
                // Buffered answers that end in this same turn of the runtime
                // stage theirs meanwhile, and one write takes them all (2–3
                // per write in the bench). Streams end one at a time (their
                // last event comes in on its own), so theirs goes at once.
                if !streamed {
                    tokio::task::yield_now().await;
                }
                journal.write_staged(seq)?;
                // Durable now. A commit that fails leaves it journaled
                // (written again until it lands): its answer still goes.
                if visible_before_answer {
                    if let Err(e) = self.flush().await {
                        tracing::warn!(
                            error = %e,
                            "an exchange the next turn must find is journaled, not yet committed"
                        );
                    }
                }
                // The answer waits only while the database is far behind.
                self.backlog.wait_below(self.max_backlog).await;
                Ok(())
            }
            Journaled::Back(rec) => self.write(Record::Exchange(rec)).await,
        }
    }

    /// Records a compaction and waits until it is committed.
    pub async fn record_compaction(&self, c: Compaction) -> Result<(), StoreError> {
        self.write(Record::Compaction(Box::new(c))).await
    }

    /// Persists a context window an upstream told.
    pub async fn record_window(&self, w: crate::windows::Told) -> Result<(), StoreError> {
        self.write(Record::Window(w)).await
    }

    /// Waits until everything recorded before the call is in the database,
    /// for readers of the database in this process.
    pub async fn flush(&self) -> Result<(), StoreError> {
        let (ack, done) = oneshot::channel();
        self.send(Cmd::Flush(Box::new(move |r| {
            let _ = ack.send(r);
        })))?;
        acked(done.await.map_err(|_| StoreError::Closed)?)
    }

    /// [`Store::flush`] for callers that may block their thread.
    pub fn flush_blocking(&self) -> Result<(), StoreError> {
        let (ack, done) = std::sync::mpsc::channel();
        self.send(Cmd::Flush(Box::new(move |r| {
            let _ = ack.send(r);
        })))?;
        acked(done.recv().map_err(|_| StoreError::Closed)?)
    }

    async fn write(&self, rec: Record) -> Result<(), StoreError> {
        let (ack, done) = oneshot::channel();
        let ack: Ack = Box::new(move |r| {
            let _ = ack.send(r);
        });
        self.send(Cmd::Write(rec, Some(ack)))?;
        acked(done.await.map_err(|_| StoreError::Closed)?)
    }

    /// Stages `rec` in the journal and queues its import; gives it back
    /// when there is no journal (any more).
    fn stage(&self, rec: ExchangeRecord) -> Result<Journaled<'_>, StoreError> {
        let Some(journal) = &self.journal else {
            return Ok(Journaled::Back(Box::new(rec)));
        };
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let mut sent = Ok(());
        let staged = journal.stage(rec, |seq, mut rec| {
            rec.journaled = true;
            let size = rec.footprint();
            self.backlog.bytes.fetch_add(size, Ordering::AcqRel);
            sent = tx
                .send(Cmd::Import(Record::Exchange(Box::new(rec)), seq, size))
                .map_err(|_| StoreError::Closed);
        })?;
        sent.map(|()| match staged {
            journal::Staged::At(seq) => Journaled::At(journal, seq),
            journal::Staged::Back(rec) => Journaled::Back(rec),
        })
    }

    /// At shutdown: imports what is journaled and hands the store over
    /// (see [`Journal::release`]); exchanges recorded later are committed.
    pub async fn close(&self) -> Result<(), StoreError> {
        let flushed = self.flush().await;
        if let Some(journal) = &self.journal {
            if flushed.is_ok() {
                journal.release();
            }
        }
        flushed
    }

    /// Records an exchange without waiting (used where nothing can wait,
    /// e.g. when a client went away and its stream is being dropped).
    pub fn record_detached(&self, rec: ExchangeRecord) {
        let result = match self.stage(rec) {
            Ok(Journaled::At(journal, seq)) => journal.write_staged(seq).map_err(StoreError::from),
            Ok(Journaled::Back(rec)) => self.send(Cmd::Write(Record::Exchange(rec), None)),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "an exchange record was lost");
        }
    }

    /// Queues `cmd` and, unless it is a journaled exchange (imported with
    /// its batch), wakes the writer for it.
    fn send(&self, cmd: Cmd) -> Result<(), StoreError> {
        let urgent = !matches!(cmd, Cmd::Import(..));
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(cmd)
            .map_err(|_| StoreError::Closed)?;
        if urgent {
            self.writer.unpark();
        }
        Ok(())
    }
}

fn acked(result: Result<(), Arc<StoreError>>) -> Result<(), StoreError> {
    result.map_err(StoreError::Commit)
}

/// Collects records and commits them: journaled ones within
/// [`IMPORT_DELAY`], others (and everything pending) when one must be
/// committed now.
///
/// Between the first journaled record of a batch and its commit the thread
/// parks rather than waiting on the queue, so the records that follow do
/// not wake it one by one; what must be committed now unparks it.
fn writer_loop(
    mut backend: Box<dyn Backend>,
    rx: mpsc::Receiver<Cmd>,
    journal: Option<Arc<Journal>>,
    backlog: Arc<Backlog>,
    commits: Arc<std::sync::OnceLock<CommitObserver>>,
    forgets: Arc<AtomicU64>,
    imports: Imports,
) {
    let mut batch = Pending {
        backlog,
        commits,
        forgets,
        imports,
        ..Pending::default()
    };
    let mut deadline: Option<Instant> = None;
    let mut open = true;
    while open {
        if batch.records.is_empty() && batch.acks.is_empty() {
            match rx.recv() {
                Ok(cmd) => batch.take(cmd, &mut deadline),
                Err(_) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => batch.take(cmd, &mut deadline),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let due = deadline.is_some_and(|d| Instant::now() >= d);
        let full = batch.records.len() >= MAX_BATCH;
        if !open || !batch.acks.is_empty() || full || due || deadline.is_none() {
            // A failed import kept for a retry sets the next deadline.
            deadline = batch.commit(&mut *backend, &journal);
        } else if let Some(d) = deadline {
            std::thread::park_timeout(d.saturating_duration_since(Instant::now()));
        }
    }
    // The handle is gone (shutdown): what is pending goes in now.
    batch.commit(&mut *backend, &journal);
}

/// What the next commit writes and acknowledges.
#[derive(Default)]
struct Pending {
    records: Vec<Record>,
    /// Each with the position in `records` of the record it waits for, if
    /// one (a flush waits for them all).
    acks: Vec<(Option<usize>, Ack)>,
    /// Sequence number of the last journaled record in `records`.
    upto: Option<u64>,
    /// Their share of the backlog (journaled records' footprints).
    bytes: usize,
    backlog: Arc<Backlog>,
    commits: Arc<std::sync::OnceLock<CommitObserver>>,
    /// The store's [`Store::forgets`].
    forgets: Arc<AtomicU64>,
    /// How journaled records are imported.
    imports: Imports,
}

impl Pending {
    /// Gives the records claimed before the items believed stored were
    /// last forgotten the bodies they left out.
    fn send_forgotten_bodies(&mut self) {
        let now = self.forgets.load(Ordering::Acquire);
        for rec in &mut self.records {
            if let Record::Exchange(e) = rec {
                if e.claimed_at != now {
                    let bodies = e.stored_items.take();
                    e.new_items.extend(bodies);
                }
            }
        }
    }

    /// Adds `cmd` to what the next commit writes (and acknowledges).
    fn take(&mut self, cmd: Cmd, deadline: &mut Option<Instant>) {
        match cmd {
            Cmd::Import(rec, seq, size) => {
                self.records.push(rec);
                self.upto = Some(seq);
                self.bytes += size;
                let delay = self.imports.delay;
                deadline.get_or_insert_with(|| Instant::now() + delay);
            }
            Cmd::Write(rec, ack) => {
                self.records.push(rec);
                let at = self.records.len() - 1;
                self.acks.extend(ack.map(|ack| (Some(at), ack)));
                // A detached write has no ack but is committed now too.
                deadline.take();
            }
            Cmd::Flush(ack) => self.acks.push((None, ack)),
        }
    }

    /// Commits what is pending; `Some(when)` to try again then what was
    /// kept (journaled records a shared database failed to take).
    fn commit(
        &mut self,
        backend: &mut dyn Backend,
        journal: &Option<Arc<Journal>>,
    ) -> Option<Instant> {
        // One result per record when the batch was refused and its records
        // then went one by one.
        let mut each: Option<Vec<Result<(), Arc<StoreError>>>> = None;
        let result = if self.records.is_empty() {
            Ok(())
        } else {
            self.send_forgotten_bodies();
            let started = Instant::now();
            let mut written = backend.write(&self.records).map_err(Arc::new);
            if let Err(e) = &written {
                if e.is_refusal() && self.records.len() > 1 {
                    tracing::warn!(
                        error = %e,
                        records = self.records.len(),
                        "the database refused a batch: its records go one by one"
                    );
                    let results: Vec<_> = backend
                        .write_each(&self.records)
                        .into_iter()
                        .map(|r| r.map_err(Arc::new))
                        .collect();
                    // The batch as a whole (a flush) failed only if the
                    // database failed, not when it refused a record.
                    written = results
                        .iter()
                        .find_map(|r| r.clone().err().filter(|e| !e.is_refusal()))
                        .map_or(Ok(()), Err);
                    each = Some(results);
                }
            }
            if let Some(observe) = self.commits.get() {
                observe(started.elapsed());
            }
            written
        };
        let refused = each.iter().flatten().filter(|r| r.is_err()).count();
        if refused > 0 {
            tracing::error!(
                records = refused,
                "the database refused records: not stored"
            );
        }
        let mut retry = None;
        match (&result, journal, self.upto.take()) {
            (Err(e), Some(_), upto) if self.imports.retry => {
                // Their clients were answered: written later, as they are.
                let journaled: Vec<Record> = self
                    .records
                    .drain(..)
                    .filter(|r| matches!(r, Record::Exchange(e) if e.journaled))
                    .collect();
                tracing::error!(
                    error = %e,
                    exchanges = journaled.len(),
                    "store write failed: the journaled exchanges are written again"
                );
                self.records = journaled;
                self.upto = upto;
                retry = Some(Instant::now() + RETRY_EVERY);
            }
            (Err(e), _, _) => {
                tracing::error!(error = %e, records = self.records.len(), "store write failed");
                if let Some(j) = journal {
                    // Its records stay journaled for the next start.
                    j.keep();
                }
            }
            (Ok(()), Some(j), _) if refused > 0 => j.keep(),
            (Ok(()), Some(j), Some(seq)) => j.imported(seq),
            _ => {}
        }
        if retry.is_none() {
            self.records.clear();
            self.backlog.release(std::mem::take(&mut self.bytes));
        }
        for (at, ack) in self.acks.drain(..) {
            let own = at.zip(each.as_ref()).and_then(|(i, each)| each.get(i));
            ack(own.cloned().unwrap_or_else(|| result.clone()));
        }
        retry
    }
}

/// Bytes of journaled exchanges waiting for their import, at most, before
/// [`Store::record`] waits for the writer: when the database falls behind
/// (a slow disk, a lock held by another process), answers slow down rather
/// than memory grows. A record's footprint is mostly its new items' text.
const MAX_BACKLOG_BYTES: usize = 256 << 20;

/// Journaled exchanges not yet imported: their bytes, and a wake-up for
/// those waiting for fewer.
#[derive(Default)]
struct Backlog {
    bytes: AtomicUsize,
    drained: tokio::sync::Notify,
}

impl Backlog {
    fn release(&self, bytes: usize) {
        if bytes > 0 {
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
            self.drained.notify_waiters();
        }
    }

    /// Returns once the backlog is at most `max` bytes.
    async fn wait_below(&self, max: usize) {
        // The usual case, without registering as a waiter.
        if self.bytes.load(Ordering::Acquire) <= max {
            return;
        }
        loop {
            let drained = self.drained.notified();
            let mut drained = std::pin::pin!(drained);
            // Registered before the check, so a release in between wakes it.
            drained.as_mut().enable();
            if self.bytes.load(Ordering::Acquire) <= max {
                return;
            }
            drained.await;
        }
    }
}

impl ExchangeRecord {
    /// About how many bytes the record holds.
    pub(super) fn footprint(&self) -> usize {
        let texts: usize = self.new_items.iter().map(|(_, body)| 32 + body.len()).sum();
        let hashes = 32 * (self.suffix_items.len() + self.response_items.len());
        let strings = self.conversation.len()
            + self.tenant.len()
            + self.model.len()
            + self.error.as_ref().map_or(0, String::len)
            + self.preview.as_ref().map_or(0, String::len)
            + self.client.as_ref().map_or(0, String::len);
        std::mem::size_of::<Self>() + texts + hashes + strings + self.stored_items.held()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::journal::tests::record;
    use crate::store::LeftOut;

    /// A record claimed before the items believed stored were last
    /// forgotten goes with the bodies it left out, made then; one claimed
    /// since goes without, and its bodies are never made.
    #[test]
    fn only_a_record_claimed_before_the_last_forget_makes_the_bodies_it_left_out() {
        let made = Arc::new(AtomicUsize::new(0));
        let left_out = |hash: ItemHash| {
            let made = made.clone();
            LeftOut::new(0, move || {
                made.fetch_add(1, Ordering::Relaxed);
                vec![(
                    hash,
                    "{\"role\":\"user\",\"content\":\"stored\"}".to_string(),
                )]
            })
        };
        let mut batch = Pending::default();
        batch.forgets.store(1, Ordering::Release);
        let mut stale = record(1);
        stale.claimed_at = 0;
        stale.stored_items = left_out([7; 32]);
        let mut current = record(2);
        current.claimed_at = 1;
        current.stored_items = left_out([8; 32]);
        batch.records = vec![
            Record::Exchange(Box::new(stale)),
            Record::Exchange(Box::new(current)),
        ];
        batch.send_forgotten_bodies();
        let sent = |i: usize| match &batch.records[i] {
            Record::Exchange(e) => e.new_items.iter().map(|(h, _)| *h).collect::<Vec<_>>(),
            _ => unreachable!(),
        };
        assert!(sent(0).contains(&[7; 32]), "the stale record sends it");
        assert!(!sent(1).contains(&[8; 32]), "the current one does not");
        assert_eq!(
            made.load(Ordering::Relaxed),
            1,
            "made once, for the stale one"
        );
    }

    /// What a record's left-out bodies keep alive counts in its footprint
    /// (which bounds a journal's backlog), until they are made.
    #[test]
    fn a_record_s_footprint_counts_the_request_its_left_out_bodies_keep() {
        let mut rec = record(1);
        let bare = rec.footprint();
        rec.stored_items = LeftOut::new(300_000, Vec::new);
        assert_eq!(rec.footprint(), bare + 300_000);
        rec.stored_items.take();
        assert_eq!(rec.footprint(), bare);
    }
}
