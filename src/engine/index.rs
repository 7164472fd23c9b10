//! The compactions this process knows, in memory: found by the covered
//! prefix's chain hash per tenant, with each conversation's calibration,
//! the back-off of compactions no request matched, the jobs under way and
//! the attempts kept for the admin API.

use foldhash::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::attempt::{Attempt, Attempts, ATTEMPTS_KEPT, ATTEMPT_CONVERSATIONS};
use super::input::Input;
use super::learned::Support;
use crate::bounded::Generations;
use crate::compaction::{rewrite, Compaction};
use crate::conversation::ConversationIndex;
use crate::store::StoredCompaction;
use crate::store::{ChainHit, LookUp, Reads, StoreError};
use crate::wire::ItemHash;

/// Bounds of the estimate calibration (a wild figure is a misreport).
pub(super) const MIN_CALIBRATION: f64 = 0.5;
pub(super) const MAX_CALIBRATION: f64 = 3.0;
/// Longest back-off, in triggering exchanges skipped.
const MAX_BACKOFF: u32 = 64;

#[derive(Default)]
pub(super) struct Backoff {
    /// Compactions registered that no request has matched since.
    pub(super) unmatched: u32,
    /// Exponent of the next back-off.
    pub(super) level: u32,
    /// Triggering exchanges still to skip.
    pub(super) skip: u32,
}

/// Conversations whose calibration is kept, per generation (see
/// [`Generations`]): one that reports usage again within this many others
/// keeps it; past that it starts again from 1 (its next usage sets it).
pub(super) const CALIBRATED: usize = 1 << 17;

/// Per (tenant, conversation): upstream tokens per estimated token. Keyed
/// by a 64-bit hash of the pair under a per-process seed, with no strings
/// to allocate per exchange: two conversations sharing a key (about one
/// chance in 2^64 / 2^18 entries) would share a figure that only scales an
/// estimate, within bounds.
pub(super) struct Calibrations {
    pub(super) by_key: Generations<u64, f64>,
    /// The conversation's last reported prompt, by the same key.
    pub(super) reported: Generations<u64, Reported>,
    /// When the upstream last read a conversation's prefix (an answered
    /// exchange, a summary call that repeated it), and how long its cache
    /// keeps it idle, by a hash of the tenant and the conversation's
    /// thread (see `engine::idle::thread`).
    pub(super) read_at: Generations<u64, (std::time::Instant, Duration)>,
    pub(super) seed: foldhash::quality::RandomState,
}

impl Default for Calibrations {
    fn default() -> Self {
        Self {
            by_key: Generations::new(CALIBRATED),
            reported: Generations::new(CALIBRATED),
            read_at: Generations::new(CALIBRATED),
            seed: Default::default(),
        }
    }
}

/// What the upstream reported of the last complete exchange of a
/// conversation: the prompt's size in its own tokens, and what that prompt
/// was (the chain hash over the items sent, the tool definitions' hash). A
/// next request that extends those items with the same tools is that many
/// tokens plus what it adds (see [`crate::engine::check_fit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reported {
    /// Chain hash after the last item sent.
    pub chain: ItemHash,
    /// The tool definitions' hash, if any were sent.
    pub tools: Option<ItemHash>,
    /// Prompt tokens the upstream reported.
    pub input_tokens: u64,
}

impl Calibrations {
    pub(super) fn key(&self, tenant: &str, conversation: &str) -> u64 {
        use std::hash::BuildHasher;
        self.seed.hash_one((tenant, conversation))
    }
}

/// Compaction bodies kept in memory, per generation (see [`Generations`]):
/// those used lately. A body holds its replacement items and extracted
/// facts (tens of kilobytes); the others are read from the store when a
/// request needs them.
pub(super) const BODIES: usize = 256;

/// A stored compaction as the registry finds it: its id and how much it
/// covers.
pub(super) struct Entry {
    pub(super) id: String,
    pub(super) covered_len: usize,
}

impl rewrite::Covering for Entry {
    fn covered_len(&self) -> usize {
        self.covered_len
    }
}

/// Conversations whose agent turn and hidden rounds are kept, per
/// generation (see [`Generations`]): one not seen within this many others
/// is forgotten, as if this process had just started.
pub const PER_CONVERSATION: usize = 1 << 14;

/// Reads a compaction's body from the store, by id.
pub type LoadCompaction = Arc<dyn Fn(&str) -> Option<Compaction> + Send + Sync>;

/// The compaction bodies used lately, and how to read the others.
pub(super) struct Bodies {
    pub(super) recent: Generations<String, Arc<Compaction>>,
    pub(super) load: Option<LoadCompaction>,
}

impl Default for Bodies {
    fn default() -> Self {
        Self {
            recent: Generations::new(BODIES),
            load: None,
        }
    }
}

/// The background jobs computing, by (tenant, conversation): each told
/// true when it ends.
pub(super) type Jobs = HashMap<(String, String), watch::Receiver<bool>>;

/// An exchange to decide once its conversation's job ends: its input, its
/// tokens, and whether they were estimated.
pub(super) type FollowUp = (Input, u64, bool);

/// The registry of stored compactions and running jobs.
#[derive(Default)]
pub struct Compactions {
    /// Every stored compaction, by tenant and covered chain (without bodies).
    pub(super) by_tenant: Mutex<HashMap<String, HashMap<ItemHash, Entry>>>,
    /// The same for observe mode's would-be compactions: found only to
    /// figure what a request would have saved, never applied.
    pub(super) observed: Mutex<HashMap<String, HashMap<ItemHash, Entry>>>,
    pub(super) jobs: Mutex<Jobs>,
    /// Per (tenant, conversation): the newest exchange that crossed the
    /// trigger while a job for the conversation ran, with its tokens and
    /// whether they were estimated. The job looks at it when it ends.
    pub(super) follow_ups: Mutex<HashMap<(String, String), FollowUp>>,
    pub(super) backoff: Mutex<HashMap<String, Backoff>>,
    /// When each conversation's newest compaction was stored (Unix ms),
    /// and its id.
    pub(super) newest: Mutex<HashMap<(String, String), (i64, String)>>,
    /// The tenant of every stored compaction, by id (to expand `compaction`
    /// items).
    pub(super) by_id: Mutex<HashMap<String, String>>,
    pub(super) bodies: Mutex<Bodies>,
    /// Per conversation: the upstream's token count over the proxy's
    /// estimate, from the last exchange that reported usage. The upstream
    /// may tokenize differently (llama, qwen…); limits are checked in its
    /// tokens.
    /// The recent conversations only: every conversation that reports
    /// usage sets one, one-off requests included.
    pub(super) calibration: Mutex<Calibrations>,
    /// Conversations whose next request is to be compacted (manual).
    pub(super) manual: Mutex<foldhash::HashSet<String>>,
    /// Compactions computed here that wait for their first application (by
    /// id): a threshold one's on the next request that extends it, the
    /// model's at a turn boundary. One this process did not compute (replayed
    /// from the store, stored by another replica) is taken as applied.
    pub(super) waiting: Mutex<foldhash::HashSet<String>>,
    /// Per (tenant, conversation): the turn (see
    /// [`crate::compaction::agent_tool::turn_of`]) whose agent compaction
    /// was scheduled last (one per turn). The recent conversations only.
    pub(super) agent_turns: Mutex<Option<Generations<(String, String), ItemHash>>>,
    /// (tenant, conversation) pairs on Anthropic Messages with thinking on
    /// where an answer followed a round the proxy answered itself. The
    /// recent conversations only.
    pub(super) hidden_rounds: Mutex<Option<Generations<(String, String), ()>>>,
    /// A store other processes write too: compactions they computed are
    /// looked up there, and computing one is claimed there first.
    pub(super) shared: Option<Arc<dyn Reads>>,
    /// The recent compaction attempts of the recent conversations, by
    /// (tenant, conversation), oldest first: discarded ones leave no
    /// compaction to show.
    pub(super) attempts: Mutex<Option<Attempts>>,
    /// Whether each upstream and model offers the provider's compaction
    /// (`compaction.summarizer = "auto"`).
    pub(super) provider: Support,
    /// What a shared store's reads told of its compactions (see
    /// [`Compactions::prefetch`]).
    pub(super) heard: Heard,
    /// Conversations past the cold threshold whose idle time is watched
    /// (see `engine::idle`), by tenant and thread: when their last exchange
    /// ended and what it sent.
    pub(super) idle: Mutex<HashMap<(String, ItemHash), (std::time::Instant, Input)>>,
}

/// What this process knows of the compactions other processes store.
#[derive(Default)]
pub(super) struct Heard {
    /// Those announced and not yet indexed (indexed at the next lookup).
    announced: Arc<Mutex<Vec<StoredCompaction>>>,
    /// Per (tenant, conversation): the [`Reads::hearing`] under which the
    /// store was last asked for the conversation's compactions. While it
    /// holds, every compaction stored since was announced: the
    /// conversation's newest is in memory.
    asked: Mutex<Option<Generations<(String, String), u64>>>,
    /// Requests (tenant, last chain) whose compaction lookup was made
    /// before they were matched: their next [`Compactions::find`] looks in
    /// memory only.
    settled: Mutex<Option<Generations<(String, ItemHash), ()>>>,
}

/// Conversations whose [`Heard::asked`] is kept, and requests whose
/// [`Heard::settled`], per generation: one asked for longer ago is asked
/// again.
const HEARD: usize = 1 << 16;

/// What a request read of a shared store before it was matched
/// ([`Compactions::prefetch`]).
#[derive(Debug, Default)]
pub struct Prefetched {
    /// The longest recorded prefix the store has, if asked and found (for
    /// [`ConversationIndex::identify_with`]).
    pub chain: Option<ChainHit>,
    /// The [`Reads::hearing`] under which the store answered for the
    /// request's compactions, if asked and answered.
    asked_under: Option<u64>,
}

/// How long a claim on computing a conversation's compaction lasts: past
/// it (a replica died mid-compaction) another may compute it. Longer than
/// a summary takes.
pub(super) const CLAIM_FOR: Duration = Duration::from_secs(120);

/// How often a request waiting for another replica's compaction looks for it.
pub(super) const FOREIGN_POLL: Duration = Duration::from_millis(100);

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Compactions {
    /// Rebuilds the registry from the stored compactions (replay); `load`
    /// reads a body from the store when a request needs one.
    pub fn from_stored(list: Vec<StoredCompaction>, load: LoadCompaction) -> Self {
        let me = Self::default();
        lock(&me.bodies).load = Some(load);
        for c in list {
            me.index(c);
        }
        me
    }

    /// The registry over a store other processes write too (see
    /// [`Reads::shared`]).
    pub fn shared_with(mut self, reads: Arc<dyn Reads>) -> Self {
        if reads.shared() {
            let announced = self.heard.announced.clone();
            reads.on_compacted(Box::new(move |c| lock(&announced).push(c)));
            self.shared = Some(reads);
        }
        self
    }

    /// Indexes the compactions announced since the last call (those this
    /// process did not store itself).
    fn take_announced(&self) {
        let announced = std::mem::take(&mut *lock(&self.heard.announced));
        for c in announced {
            if !lock(&self.by_id).contains_key(&c.id) {
                self.index(c);
            }
        }
    }

    /// Reads what a store other processes write may have of a request
    /// that memory lacks, before the request is matched: the longest
    /// recorded prefix past the one memory has (see
    /// [`ConversationIndex::to_look_up`]), and a compaction covering more
    /// than memory's (or else the body of memory's, if not kept), in one
    /// round trip ([`Reads::look_up`]), awaited. A compaction found is
    /// indexed, and the request's next [`Compactions::find`] looks in
    /// memory only.
    ///
    /// The compactions are not asked for when the request continues a
    /// conversation whose newest compaction this process knows: the store
    /// was asked for it while this process has heard every compaction
    /// stored since (its own, or announced by another). Nothing is read
    /// when neither is asked, nor from a store only this process writes.
    pub async fn prefetch(
        &self,
        conversations: &ConversationIndex,
        tenant: &str,
        chains: &[ItemHash],
    ) -> Prefetched {
        let (Some(shared), Some(last)) = (&self.shared, chains.last()) else {
            return Prefetched::default();
        };
        self.take_announced();
        let crate::conversation::ToLookUp {
            prefix_from,
            conversation,
            goes_on,
        } = conversations.to_look_up(tenant, chains);
        let (kept, covered) = {
            let idx = lock(&self.by_tenant);
            idx.get(tenant)
                .and_then(|m| rewrite::find(chains, m))
                .map_or((None, 0), |e| (Some(e.id.clone()), e.covered_len))
        };
        // The body of the one memory has, unless kept: read along.
        let body_of = kept.filter(|id| lock(&self.bodies).recent.get(id).is_none());
        let hearing = shared.hearing();
        let known = conversation.is_some_and(|c| {
            let asked = lock(&self.heard.asked);
            let under = asked.as_ref().and_then(|a| a.get(&(tenant.to_string(), c)));
            hearing.is_some() && under.copied() == hearing
        });
        let covering_from = (!known && covered < chains.len()).then_some(covered);
        let ask = LookUp {
            prefix_from,
            covering_from,
            body_of: body_of.clone(),
            goes_on,
        };
        lock(&self.heard.settled)
            .get_or_insert_with(|| Generations::new(HEARD))
            .insert((tenant.to_string(), *last), ());
        let found = shared.look_up(tenant, chains, ask).await;
        if let Some(c) = found.compaction {
            if Some(&c.id) == body_of.as_ref() {
                lock(&self.bodies).recent.insert(c.id.clone(), Arc::new(c));
            } else if c.covered_len > covered
                && chains.get(c.covered_len - 1) == Some(&c.covered_chain)
            {
                self.insert(Arc::new(c));
            }
        }
        Prefetched {
            chain: found.chain,
            asked_under: hearing.filter(|_| covering_from.is_some() && found.answered),
        }
    }

    /// The request [`Compactions::prefetch`] read for is matched to
    /// `conversation`: if the store was asked for its compactions, its
    /// newest is known from now on (while every compaction stored is
    /// heard).
    pub fn matched(&self, tenant: &str, conversation: &str, prefetched: &Prefetched) {
        if let Some(under) = prefetched.asked_under {
            lock(&self.heard.asked)
                .get_or_insert_with(|| Generations::new(HEARD))
                .insert((tenant.to_string(), conversation.to_string()), under);
        }
    }

    /// Adds a compaction just stored.
    pub(super) fn insert(&self, c: Arc<Compaction>) {
        self.index(StoredCompaction::from(&*c));
        lock(&self.bodies).recent.insert(c.id.clone(), c);
    }

    pub(super) fn index(&self, c: StoredCompaction) {
        let StoredCompaction {
            id,
            tenant,
            conversation,
            covered_len,
            covered_chain,
            created_ms,
            observed,
        } = c;
        // The time it became visible, not when it was computed: a request
        // that started before this moment may have missed it.
        let visible = crate::ids::now_ms().max(created_ms);
        let mut newest = lock(&self.newest);
        let at = newest.entry((tenant.clone(), conversation)).or_default();
        if visible >= at.0 {
            *at = (visible, id.clone());
        }
        drop(newest);
        lock(&self.by_id).insert(id.clone(), tenant.clone());
        let index = if observed {
            &self.observed
        } else {
            &self.by_tenant
        };
        lock(index)
            .entry(tenant)
            .or_default()
            .insert(covered_chain, Entry { id, covered_len });
    }

    /// A compaction's body: kept, or read from the store (a stored one
    /// that cannot be read is treated as absent: the request goes as the
    /// client sent it).
    pub(super) fn body(&self, id: &str) -> Option<Arc<Compaction>> {
        let load = {
            let mut bodies = lock(&self.bodies);
            // Used again: kept into the next generation.
            if let Some(c) = bodies.recent.renew(id) {
                return Some(c.clone());
            }
            bodies.load.clone()?
        };
        // Read without the lock: other requests' lookups go on meanwhile.
        let c = match load(id) {
            Some(c) => Arc::new(c),
            None => {
                tracing::warn!(compaction = %id, "stored compaction could not be read");
                return None;
            }
        };
        lock(&self.bodies).recent.insert(id.to_string(), c.clone());
        Some(c)
    }

    /// The longest stored compaction of `tenant` that covers a prefix of the
    /// request; a match also clears the tenant's back-off.
    pub fn find(&self, tenant: &str, chains: &[ItemHash]) -> Option<Arc<Compaction>> {
        self.find_in(&self.by_tenant, tenant, chains, true)
    }

    /// [`Compactions::find`] among observe mode's would-be compactions
    /// (this replica's own: they are never applied, so never shared).
    pub fn find_observed(&self, tenant: &str, chains: &[ItemHash]) -> Option<Arc<Compaction>> {
        self.find_in(&self.observed, tenant, chains, false)
    }

    pub(super) fn find_in(
        &self,
        index: &Mutex<HashMap<String, HashMap<ItemHash, Entry>>>,
        tenant: &str,
        chains: &[ItemHash],
        applied: bool,
    ) -> Option<Arc<Compaction>> {
        self.take_announced();
        let (mut id, covered) = {
            let idx = lock(index);
            idx.get(tenant)
                .and_then(|m| rewrite::find(chains, m))
                .map_or((None, 0), |e| (Some(e.id.clone()), e.covered_len))
        };
        // Another replica may have stored one covering more since: asked
        // unless [`Compactions::prefetch`] just did (then once only: a
        // later lookup of the request, after it waited or before it is
        // compacted, asks).
        let settled = chains.last().is_some_and(|last| {
            lock(&self.heard.settled)
                .as_mut()
                .and_then(|s| s.remove(&(tenant.to_string(), *last)))
                .is_some()
        });
        if let Some(shared) = self.shared.as_ref().filter(|_| applied && !settled) {
            let longer = &chains[covered.min(chains.len())..];
            if let Some(c) = shared.compaction_covering(tenant, longer) {
                if c.covered_len > covered
                    && chains.get(c.covered_len - 1) == Some(&c.covered_chain)
                {
                    id = Some(c.id.clone());
                    self.index(c);
                }
            }
        }
        let id = id?;
        let found = self.body(&id);
        if found.is_some() {
            if let Some(b) = lock(&self.backoff).get_mut(tenant) {
                *b = Backoff::default();
            }
        }
        found
    }

    /// Keeps an attempt's outcome; with a shared store, one that stored
    /// nothing is kept there too, for any replica asked for it.
    pub(super) fn attempted(&self, key: (String, String), attempt: Attempt) {
        if let (Some(shared), Some(record)) = (self.shared.clone(), attempt.unstored()) {
            let (tenant, conversation) = key.clone();
            tokio::task::spawn_blocking(move || {
                shared.record_attempt(&tenant, &conversation, &record)
            });
        }
        let mut attempts = lock(&self.attempts);
        let map = attempts.get_or_insert_with(|| Generations::new(ATTEMPT_CONVERSATIONS));
        let mut list = map.renew(&key).cloned().unwrap_or_default();
        list.push(attempt);
        if list.len() > ATTEMPTS_KEPT {
            list.remove(0);
        }
        map.insert(key, list);
    }

    /// The conversation's recent attempts, oldest first (those of a
    /// conversation not seen for long are forgotten).
    pub fn attempts(&self, tenant: &str, conversation: &str) -> Vec<Attempt> {
        lock(&self.attempts)
            .as_ref()
            .and_then(|m| {
                m.get(&(tenant.to_string(), conversation.to_string()))
                    .cloned()
            })
            .unwrap_or_default()
    }

    /// Forgets `tenant`'s compactions `ids` (their conversation was
    /// deleted): no request is rewritten by them any more.
    pub fn forget(&self, tenant: &str, ids: &[String]) {
        let mut by_id = lock(&self.by_id);
        for id in ids {
            by_id.remove(id);
        }
        drop(by_id);
        // Observe mode's would-be compactions go too: a deleted one would
        // still be offered as what a request would have saved.
        for index in [&self.by_tenant, &self.observed] {
            if let Some(m) = lock(index).get_mut(tenant) {
                m.retain(|_, e| !ids.contains(&e.id));
            }
        }
    }

    /// A stored compaction by id, only if it belongs to `tenant` (and was
    /// applied, not observed).
    pub fn get(&self, tenant: &str, id: &str) -> Option<Arc<Compaction>> {
        let owned = lock(&self.by_id).get(id).is_some_and(|t| t == tenant);
        if owned {
            self.body(id).filter(|c| !c.observed)
        } else {
            None
        }
    }

    /// Learns how the upstream's token counts compare with the estimate.
    pub fn calibrate(&self, tenant: &str, conversation: &str, reported: u64, estimated: u64) {
        if reported == 0 || estimated == 0 {
            return;
        }
        let ratio = (reported as f64 / estimated as f64).clamp(MIN_CALIBRATION, MAX_CALIBRATION);
        let mut all = lock(&self.calibration);
        let key = all.key(tenant, conversation);
        all.by_key.insert(key, ratio);
    }

    /// Keeps the conversation's last reported prompt (see [`Reported`]).
    pub fn report(&self, tenant: &str, conversation: &str, reported: Reported) {
        if reported.input_tokens == 0 {
            return;
        }
        let mut all = lock(&self.calibration);
        let key = all.key(tenant, conversation);
        all.reported.insert(key, reported);
    }

    /// The conversation's last reported prompt, if it is known here.
    pub fn last_reported(&self, tenant: &str, conversation: &str) -> Option<Reported> {
        let all = lock(&self.calibration);
        all.reported.get(&all.key(tenant, conversation)).copied()
    }

    /// Upstream tokens per estimated token for the conversation (1 until known).
    pub fn calibration(&self, tenant: &str, conversation: &str) -> f64 {
        let all = lock(&self.calibration);
        all.by_key
            .get(&all.key(tenant, conversation))
            .copied()
            .unwrap_or(1.0)
    }

    /// Asks for the conversation's next request to be compacted, like
    /// Codex's `/compact`. The proxy needs that request's credentials for
    /// the summary, so it happens then. False if already asked. With a
    /// shared store the request is recorded there, so whichever process
    /// serves that request honours it.
    pub fn request_manual(&self, conversation: &str) -> Result<bool, StoreError> {
        match &self.shared {
            Some(shared) => shared.request_manual(conversation),
            None => Ok(lock(&self.manual).insert(conversation.to_string())),
        }
    }

    /// Whether a manual compaction of the conversation waits for its next
    /// request (with a shared store, whichever process was asked).
    pub fn manual_pending(&self, conversation: &str) -> Result<bool, StoreError> {
        match &self.shared {
            Some(shared) => shared.manual_pending(conversation),
            None => Ok(lock(&self.manual).contains(conversation)),
        }
    }

    /// Takes a pending manual request for the tenant's conversation. Every
    /// request passes here: with a shared store, only one whose
    /// conversation this process heard of asks the store, and of the
    /// processes racing for it one gets it.
    pub fn take_manual(&self, tenant: &str, conversation: &str) -> bool {
        match &self.shared {
            Some(shared) => {
                shared.manual_heard(conversation) && shared.take_manual(tenant, conversation)
            }
            None => lock(&self.manual).remove(conversation),
        }
    }

    /// The upstream read the prefix of the conversation `thread` names
    /// (see `engine::idle::thread`) now, and keeps it cached `ttl` while
    /// idle.
    pub fn read_now(&self, tenant: &str, thread: &ItemHash, ttl: Duration) {
        let mut all = lock(&self.calibration);
        let key = {
            use std::hash::BuildHasher;
            all.seed.hash_one((tenant, thread))
        };
        all.read_at.insert(key, (std::time::Instant::now(), ttl));
    }

    /// Whether the upstream's cache of the conversation's prefix has
    /// expired: idle past its lifetime since the upstream last read it.
    /// One this process never saw read (or forgot) is taken as expired.
    pub fn cache_expired(&self, tenant: &str, thread: &ItemHash) -> bool {
        let mut all = lock(&self.calibration);
        let key = {
            use std::hash::BuildHasher;
            all.seed.hash_one((tenant, thread))
        };
        all.read_at
            .renew(&key)
            .is_none_or(|(at, ttl)| at.elapsed() > *ttl)
    }

    /// Whether a stored compaction still waits for its first application
    /// (the model's own: at a turn boundary).
    pub fn is_waiting(&self, id: &str) -> bool {
        lock(&self.waiting).contains(id)
    }

    /// A compaction is applied to a request: true if this is its first
    /// application after it waited (from then on every request that extends
    /// its prefix gets it).
    pub fn first_applied(&self, id: &str) -> bool {
        lock(&self.waiting).remove(id)
    }

    /// The model asked for a compaction in `turn` of the conversation:
    /// true if it is the first request of that turn to ask (one per turn).
    pub fn schedule_agent_turn(&self, tenant: &str, conversation: &str, turn: ItemHash) -> bool {
        let key = (tenant.to_string(), conversation.to_string());
        lock(&self.agent_turns)
            .get_or_insert_with(|| Generations::new(PER_CONVERSATION))
            .insert(key, turn)
            != Some(turn)
    }

    /// An answer of the conversation followed a round the proxy answered
    /// itself, with thinking on: its thinking is signed against a prefix the
    /// client's history lacks.
    pub fn mark_hidden_round(&self, tenant: &str, conversation: &str) {
        lock(&self.hidden_rounds)
            .get_or_insert_with(|| Generations::new(PER_CONVERSATION))
            .insert((tenant.to_string(), conversation.to_string()), ());
    }

    /// Whether [`Compactions::mark_hidden_round`] was called for the
    /// conversation (in this process).
    pub fn had_hidden_round(&self, tenant: &str, conversation: &str) -> bool {
        lock(&self.hidden_rounds)
            .as_mut()
            .and_then(|m| m.renew(&(tenant.to_string(), conversation.to_string())))
            .is_some()
    }

    /// A background job still computing for this conversation.
    pub fn job(&self, tenant: &str, conversation: &str) -> Option<watch::Receiver<bool>> {
        lock(&self.jobs)
            .get(&(tenant.to_string(), conversation.to_string()))
            .filter(|rx| !*rx.borrow())
            .cloned()
    }

    /// How many background jobs are computing now (any conversation).
    pub fn jobs_under_way(&self) -> usize {
        lock(&self.jobs).values().filter(|rx| !*rx.borrow()).count()
    }

    /// Number of stored compactions.
    pub fn len(&self) -> usize {
        self.take_announced();
        lock(&self.by_tenant).values().map(HashMap::len).sum()
    }

    /// Whether none is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a triggering exchange of `tenant` should be skipped: after
    /// two compactions nothing matched, skip 2, 4, 8… triggers.
    pub(super) fn backing_off(&self, tenant: &str) -> bool {
        let mut all = lock(&self.backoff);
        let b = all.entry(tenant.to_string()).or_default();
        if b.skip > 0 {
            b.skip -= 1;
            return true;
        }
        if b.unmatched >= 2 {
            b.level += 1;
            b.skip = (1u32 << b.level.min(6)).min(MAX_BACKOFF) - 1;
            b.unmatched = 0;
            return true;
        }
        // Counted when the job starts, so jobs racing each other see it.
        b.unmatched += 1;
        false
    }

    /// A background job produced nothing: it cannot go unmatched.
    pub(super) fn job_failed(&self, tenant: &str) {
        if let Some(b) = lock(&self.backoff).get_mut(tenant) {
            b.unmatched = b.unmatched.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::error::CompactError;
    use super::*;
    use serde_json::json;

    #[test]
    fn attempts_keep_what_a_discarded_compaction_would_have_sent() {
        let registry = Compactions::default();
        let discarded: Result<Arc<Compaction>, CompactError> = Err(CompactError::NoShrink {
            before: 99,
            after: 259,
        });
        registry.attempted(("t".into(), "c".into()), Attempt::of(&discarded));
        let kept = registry.attempts("t", "c");
        assert_eq!(kept.len(), 1);
        assert_eq!(
            (kept[0].result, kept[0].tokens_before, kept[0].tokens_after),
            ("discarded", Some(99), Some(259))
        );
        assert!(registry.attempts("u", "c").is_empty(), "another tenant's");
        for _ in 0..ATTEMPTS_KEPT + 5 {
            registry.attempted(("t".into(), "c".into()), Attempt::of(&discarded));
        }
        assert_eq!(registry.attempts("t", "c").len(), ATTEMPTS_KEPT);
    }

    #[test]
    fn calibrations_are_per_tenant_and_conversation() {
        let c = Compactions::default();
        c.calibrate("t1", "conv", 200, 100);
        c.calibrate("ab", "c", 150, 100);
        assert_eq!(c.calibration("t1", "conv"), 2.0);
        assert_eq!(c.calibration("t2", "conv"), 1.0, "another tenant");
        assert_eq!(c.calibration("t1", "other"), 1.0, "another conversation");
        assert_eq!(c.calibration("ab", "c"), 1.5);
        assert_eq!(
            c.calibration("a", "bc"),
            1.0,
            "the pair, not its concatenation"
        );
    }

    /// The chain hash the tests give a prefix of `len` items.
    fn chain(len: usize) -> ItemHash {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&(len as u64).to_le_bytes());
        h
    }

    /// A compaction of `tenant` covering the first `len` items.
    fn stored(tenant: &str, len: usize) -> Compaction {
        crate::compaction::test_compaction(
            &format!("cmp_{tenant}_{len}"),
            tenant,
            len,
            chain(len),
            vec![json!({"role": "user", "content": format!("summary {len}")})],
        )
    }

    #[test]
    fn a_forgotten_compaction_is_found_neither_applied_nor_observed() {
        let (applied, mut observed) = (stored("t", 3), stored("t", 5));
        observed.id = "cmp_t_observed".into();
        observed.observed = true;
        let bodies: HashMap<String, Compaction> = [applied.clone(), observed.clone()]
            .into_iter()
            .map(|c| (c.id.clone(), c))
            .collect();
        let list = bodies.values().map(StoredCompaction::from).collect();
        let registry =
            Compactions::from_stored(list, Arc::new(move |id: &str| bodies.get(id).cloned()));
        let chains: Vec<ItemHash> = (1..=6).map(chain).collect();
        assert!(registry.find("t", &chains).is_some());
        assert!(registry.find_observed("t", &chains).is_some());
        registry.forget("t", &[applied.id.clone(), observed.id.clone()]);
        assert!(
            registry.find("t", &chains).is_none(),
            "applied one forgotten"
        );
        assert!(
            registry.find_observed("t", &chains).is_none(),
            "observed one forgotten"
        );
    }

    #[test]
    fn stored_compactions_are_found_with_bodies_read_when_not_kept() {
        // More than two generations of bodies, all in the "store".
        let n = 2 * BODIES + 40;
        let store: HashMap<String, Compaction> = (1..=n)
            .map(|len| stored("t", len))
            .map(|c| (c.id.clone(), c))
            .collect();
        let list = store.values().map(StoredCompaction::from).collect();
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = reads.clone();
        let registry = Compactions::from_stored(
            list,
            Arc::new(move |id: &str| {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                store.get(id).cloned()
            }),
        );
        assert_eq!(registry.len(), n);
        // A request whose first `len` items are each one's covered prefix.
        let chains = |len: usize| -> Vec<ItemHash> { (1..=len).map(chain).collect() };
        let c = registry.find("t", &chains(n)).expect("the longest one");
        assert_eq!((c.covered_len, c.replacement.len()), (n, 1));
        assert_eq!(
            reads.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "read once"
        );
        let again = registry.find("t", &chains(n)).unwrap();
        assert!(Arc::ptr_eq(&c, &again), "then kept");
        assert_eq!(reads.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(
            registry.find("other", &chains(n)).is_none(),
            "never another tenant's"
        );
        assert!(registry.get("other", &c.id).is_none());
        assert_eq!(
            registry.get("t", &c.id).map(|g| g.id.clone()),
            Some(c.id.clone())
        );
        // Every one is found, though not all bodies fit in memory at once.
        for len in 1..=n {
            let found = registry.find("t", &chains(len)).unwrap();
            assert_eq!(found.id, format!("cmp_t_{len}"));
        }
        assert!(lock(&registry.bodies).recent.len() <= 2 * BODIES);
        let before = reads.load(std::sync::atomic::Ordering::Relaxed);
        // Each once, and the longest (read first) again at the end of the
        // loop: more than two generations were read after it.
        assert_eq!(before, n + 1);
        registry.find("t", &chains(1)).unwrap();
        assert_eq!(
            reads.load(std::sync::atomic::Ordering::Relaxed),
            before + 1,
            "the oldest was dropped from memory and is read again"
        );
    }

    #[test]
    fn a_new_compaction_is_kept_without_a_store() {
        let registry = Compactions::default();
        let c = Arc::new(stored("t", 3));
        registry.insert(c.clone());
        let chains: Vec<ItemHash> = (1..=4).map(chain).collect();
        assert!(Arc::ptr_eq(&registry.find("t", &chains).unwrap(), &c));
        assert!(registry.find("t", &chains[..2]).is_none(), "covers 3 items");
    }
}
