//! What is running: the background jobs and the exchanges that wait for
//! them to end, the manual compactions asked for, the compactions that wait
//! for their first application, and the conversations whose idle time is
//! watched. One lock. (Claims on computing a compaction, with a store
//! shared by replicas, are the store's: see `engine::jobs`.)

use foldhash::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::guard::lock;
use super::input::Input;
use crate::bounded::Generations;
use crate::wire::ItemHash;

/// Compactions kept waiting for their first application, and
/// conversations kept asked to compact, per generation: one past it is
/// taken as applied, or as no longer asked.
const RECENT: usize = 1 << 14;

/// A conversation: (tenant, conversation).
type Key = (String, String);

/// An exchange to decide once its conversation's job ends: its input, its
/// tokens, and whether they were estimated.
pub(super) type FollowUp = (Input, u64, bool);

/// What is running, under the part's lock.
struct Under {
    /// The background jobs computing, by conversation: each told true when
    /// it ends. A job's entry goes when it ends.
    jobs: HashMap<Key, watch::Receiver<bool>>,
    /// Per conversation: the newest exchange that crossed the trigger
    /// while a job for the conversation ran, with its tokens and whether
    /// they were estimated. The job takes it when it ends.
    follow_ups: HashMap<Key, FollowUp>,
    /// Conversations whose next request is to be compacted (manual, with
    /// a store only this process writes). The recent ones.
    manual: Generations<String, ()>,
    /// Compactions computed here that wait for their first application
    /// (by id): a threshold one's on the next request that extends it, the
    /// model's at a turn boundary. One this process did not compute
    /// (replayed from the store, stored by another replica) is taken as
    /// applied. The recent ones.
    waiting: Generations<String, ()>,
    /// Conversations past the cold threshold whose idle time is watched
    /// (see `engine::idle`), by tenant and thread: when their last
    /// exchange ended and what it sent. An entry goes when its watcher
    /// wakes past the wait, or the conversation leaves the threshold.
    idle: HashMap<(String, ItemHash), (Instant, Input)>,
}

impl Default for Under {
    fn default() -> Self {
        Self {
            jobs: HashMap::default(),
            follow_ups: HashMap::default(),
            manual: Generations::new(RECENT),
            waiting: Generations::new(RECENT),
            idle: HashMap::default(),
        }
    }
}

impl Under {
    /// Whether a job for `key` is under way.
    fn running(&self, key: &Key) -> bool {
        self.jobs.get(key).is_some_and(|rx| !*rx.borrow())
    }

    /// Starts a job for `key`: the sender its end is told with.
    fn start(&mut self, key: &Key) -> watch::Sender<bool> {
        let (tx, rx) = watch::channel(false);
        self.jobs.insert(key.clone(), rx);
        tx
    }
}

/// Where an idle conversation's watch stands (see [`Running::idle_due`]).
pub(super) enum Idle {
    /// No longer watched.
    Gone,
    /// Idle long enough: its last exchange's input, no longer watched.
    Due(Box<Input>),
    /// Not yet: look again then.
    Until(Instant),
}

/// The jobs, manual requests, waiting compactions and idle watches.
#[derive(Default)]
pub(super) struct Running {
    under: Mutex<Under>,
}

impl Running {
    /// A background job still computing for this conversation.
    pub(super) fn job(&self, key: &Key) -> Option<watch::Receiver<bool>> {
        lock(&self.under)
            .jobs
            .get(key)
            .filter(|rx| !*rx.borrow())
            .cloned()
    }

    /// How many background jobs are computing now (any conversation).
    pub(super) fn jobs_under_way(&self) -> usize {
        lock(&self.under)
            .jobs
            .values()
            .filter(|rx| !*rx.borrow())
            .count()
    }

    /// `next` back when no job for `key` is under way; else kept as the
    /// conversation's follow-up (the job decides it when it ends).
    pub(super) fn unless_running(&self, key: &Key, next: FollowUp) -> Option<FollowUp> {
        let mut under = lock(&self.under);
        Self::follow_up(&mut under, key, next)
    }

    fn follow_up(under: &mut Under, key: &Key, next: FollowUp) -> Option<FollowUp> {
        if !under.running(key) {
            return Some(next);
        }
        under.follow_ups.insert(key.clone(), next);
        None
    }

    /// Starts a job for `key` with `next`, unless one is under way (then
    /// `next` is its follow-up) or `may` says no: `next`'s input and the
    /// sender the job's end is told with.
    ///
    /// `may` runs under this part's lock, so that two exchanges racing for
    /// one conversation start one job: it may take the lock of the back-off
    /// ([`super::learned::Learned`]), whose methods never take this one.
    pub(super) fn start(
        &self,
        key: &Key,
        next: FollowUp,
        may: impl FnOnce(&Input) -> bool,
    ) -> Option<(Input, watch::Sender<bool>)> {
        let mut under = lock(&self.under);
        let (input, _, _) = Self::follow_up(&mut under, key, next)?;
        if !may(&input) {
            return None;
        }
        Some((input, under.start(key)))
    }

    /// Starts a job for `key` unless one is under way: the sender its end
    /// is told with.
    pub(super) fn start_unless_running(&self, key: &Key) -> Option<watch::Sender<bool>> {
        let mut under = lock(&self.under);
        (!under.running(key)).then(|| under.start(key))
    }

    /// The job for `key` is done with what it computed: the follow-up
    /// kept meanwhile, or, if none, the job ends (its waiters told by `tx`).
    pub(super) fn next_or_end(&self, key: &Key, tx: &watch::Sender<bool>) -> Option<FollowUp> {
        let mut under = lock(&self.under);
        let next = under.follow_ups.remove(key);
        if next.is_none() {
            let _ = tx.send(true);
            under.jobs.remove(key);
        }
        next
    }

    /// Asks for the conversation's next request to be compacted: false if
    /// already asked.
    pub(super) fn ask_manual(&self, conversation: &str) -> bool {
        lock(&self.under)
            .manual
            .insert(conversation.to_string(), ())
            .is_none()
    }

    /// Whether a manual compaction of the conversation waits.
    pub(super) fn manual_pending(&self, conversation: &str) -> bool {
        lock(&self.under).manual.get(conversation).is_some()
    }

    /// Takes the conversation's pending manual request, if any.
    pub(super) fn take_manual(&self, conversation: &str) -> bool {
        lock(&self.under).manual.remove(conversation).is_some()
    }

    /// The compaction `id`, computed here, waits for its first application.
    pub(super) fn wait(&self, id: &str) {
        lock(&self.under).waiting.insert(id.to_string(), ());
    }

    /// Whether the compaction `id` still waits for its first application.
    pub(super) fn is_waiting(&self, id: &str) -> bool {
        lock(&self.under).waiting.get(id).is_some()
    }

    /// The compaction `id` is applied: true if it waited until now.
    pub(super) fn first_applied(&self, id: &str) -> bool {
        lock(&self.under).waiting.remove(id).is_some()
    }

    /// Watches the idle time of `thread` from now, its last exchange's
    /// `input`: true if nothing watched it yet (a watcher is to be
    /// started; one already running sees the new time).
    pub(super) fn watch_idle(&self, thread: (String, ItemHash), input: Input) -> bool {
        lock(&self.under)
            .idle
            .insert(thread, (Instant::now(), input))
            .is_none()
    }

    /// Stops watching the idle time of `thread`.
    pub(super) fn unwatch_idle(&self, thread: &(String, ItemHash)) {
        lock(&self.under).idle.remove(thread);
    }

    /// Whether `thread` has been idle for `wait` since its last exchange.
    pub(super) fn idle_due(&self, thread: &(String, ItemHash), wait: Duration) -> Idle {
        let mut under = lock(&self.under);
        let Some((at, _)) = under.idle.get(thread) else {
            return Idle::Gone;
        };
        let due = *at + wait;
        if Instant::now() < due {
            return Idle::Until(due);
        }
        match under.idle.remove(thread) {
            Some((_, input)) => Idle::Due(Box::new(input)),
            None => Idle::Gone,
        }
    }
}
