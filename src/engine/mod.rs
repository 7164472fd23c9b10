//! The compaction engine: the I/O around the pure layer. Keeps the
//! per-tenant index of stored compactions, runs background jobs after a
//! triggering answer, computes reactive compactions on overflow, calls the
//! summarizer, stores results, and backs off from clients whose edits keep
//! compactions from ever matching.

pub mod provider;

use foldhash::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderMap;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::bounded::Generations;
use crate::compaction::fit::{self, CannotFit, FitInput};
use crate::compaction::policy::{decide, fit_limit, hard_limit, Stated, FIT_MARGIN};
use crate::compaction::summary;
use crate::compaction::{cheap_rungs, prepare, rewrite, Compaction, Params, Rung};
use crate::config::{Config, ModelLimits};
use crate::metrics::Metrics;
use crate::store::StoredCompaction;
use crate::store::{Reads, Store, StoreError};
use crate::tokens::TokenCounter;
use crate::upstream::Upstream;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{item_hash, Api, ItemHash};

/// Bytes of one item's text shown to the summarizer (head and tail kept).
const TRANSCRIPT_ITEM_BYTES: usize = 2_000;
/// Bounds of the estimate calibration (a wild figure is a misreport).
const MIN_CALIBRATION: f64 = 0.5;
const MAX_CALIBRATION: f64 = 3.0;
/// Longest back-off, in triggering exchanges skipped.
const MAX_BACKOFF: u32 = 64;

/// Why no compaction came out.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// No safe cut leaves anything to compact.
    #[error("no safe cut point")]
    NothingToCompact,
    /// The result would not be smaller (circuit breaker).
    #[error("compaction discarded: {before} tokens before, {after} after")]
    NoShrink {
        /// Tokens before.
        before: u64,
        /// Tokens after.
        after: u64,
    },
    /// Not even the irreducible core fits: decided from token counts,
    /// before any summarizer call.
    #[error(transparent)]
    CannotFit(#[from] CannotFit),
    /// A worker thread failed.
    #[error("internal: {0}")]
    Internal(String),
}

impl CompactError {
    /// The answer to a client that asked for this compaction: its history
    /// gave nothing to compact, unless the proxy itself failed.
    pub fn into_refusal(self) -> crate::error::ProxyError {
        match self {
            CompactError::Internal(detail) => crate::error::ProxyError::Internal(detail),
            other => crate::error::ProxyError::NothingToCompact(Box::new(other)),
        }
    }
}

/// What a compaction starts from: the request as it would go upstream.
#[derive(Clone)]
pub struct Input {
    /// The conversation's wire format (the summary call uses it too).
    pub api: Api,
    /// Tenant.
    pub tenant: String,
    /// Conversation.
    pub conversation: String,
    /// The conversation's model.
    pub model: String,
    /// The request's items after any compaction already applied.
    pub view: Arc<ItemList>,
    /// Chain hashes of the original (client-sent) items.
    pub chains: Arc<Vec<ItemHash>>,
    /// The compaction already applied, if any.
    pub base: Option<Arc<Compaction>>,
    /// The client's credential headers, for the summarizer call (memory only).
    pub auth: HeaderMap,
    /// Why.
    pub reason: String,
    /// When the request arrived (Unix ms).
    pub requested_ms: i64,
    /// Compact the whole history, keeping no verbatim tail (explicit
    /// compaction requests: `/v1/responses/compact`, `compaction_trigger`).
    pub whole: bool,
    /// What the result must achieve.
    pub goal: Goal,
    /// The request's tool definitions (they count against the window).
    pub tools: Option<Tools>,
    /// The request's top-level `system` (Anthropic Messages), which the
    /// provider's compaction call sends as the conversation does.
    pub system: Option<Value>,
    /// Observe mode: the result is recorded as what the proxy would have
    /// done, never applied. `view` is then the client's items and `base`
    /// the would-be compaction before, which is applied here first.
    pub observe: bool,
    /// The request asks the provider to compact
    /// ([`crate::compaction::boundary::asks_provider_compaction`]): the
    /// threshold trigger leaves the conversation to it.
    pub provider_compaction: bool,
    /// The result waits for the conversation's next turn boundary before
    /// its first application (a background compaction: threshold, agent),
    /// unless a request over the hard limit needs it sooner.
    pub soft: bool,
    /// The model's own notes of what to keep (its `compactor_compact`
    /// call): the compaction is a summary, and they are a section of it.
    pub keep: Option<String>,
    /// The threshold starts no compaction after this exchange: one already
    /// waits for the turn boundary, or the mode is manual.
    pub no_trigger: bool,
}

/// What a compaction must achieve; it escalates past the ladder until it
/// does, or declines before any summarizer call when nothing could.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Goal {
    /// Shrink the request by [`FIT_MARGIN`] at least (background, manual).
    #[default]
    Shrink,
    /// Fit the model's hard limit, window less max output (the pre-send
    /// check, explicit compaction requests).
    HardLimit,
    /// The upstream refused the request as too long.
    Overflow {
        /// What its answer stated.
        stated: Stated,
        /// The request's own max output, if it set one.
        max_output: Option<u64>,
    },
}

#[derive(Default)]
struct Backoff {
    /// Compactions registered that no request has matched since.
    unmatched: u32,
    /// Exponent of the next back-off.
    level: u32,
    /// Triggering exchanges still to skip.
    skip: u32,
}

/// Conversations whose calibration is kept, per generation (see
/// [`Generations`]): one that reports usage again within this many others
/// keeps it; past that it starts again from 1 (its next usage sets it).
const CALIBRATED: usize = 1 << 17;

/// Per (tenant, conversation): upstream tokens per estimated token. Keyed
/// by a 64-bit hash of the pair under a per-process seed, with no strings
/// to allocate per exchange: two conversations sharing a key (about one
/// chance in 2^64 / 2^18 entries) would share a figure that only scales an
/// estimate, within bounds.
struct Calibrations {
    by_key: Generations<u64, f64>,
    seed: foldhash::quality::RandomState,
}

impl Default for Calibrations {
    fn default() -> Self {
        Self {
            by_key: Generations::new(CALIBRATED),
            seed: Default::default(),
        }
    }
}

impl Calibrations {
    fn key(&self, tenant: &str, conversation: &str) -> u64 {
        use std::hash::BuildHasher;
        self.seed.hash_one((tenant, conversation))
    }
}

/// Compaction bodies kept in memory, per generation (see [`Generations`]):
/// those used lately. A body holds its replacement items and extracted
/// facts (tens of kilobytes); the others are read from the store when a
/// request needs them.
const BODIES: usize = 256;

/// A stored compaction as the registry finds it: its id and how much it
/// covers.
struct Entry {
    id: String,
    covered_len: usize,
}

impl rewrite::Covering for Entry {
    fn covered_len(&self) -> usize {
        self.covered_len
    }
}

/// What the engine uses of the process's shared state, and nothing more: the
/// composition root implements it, so the engine names no server, and a
/// test can run it over a context of its own.
pub trait Context: Send + Sync + 'static {
    /// The configuration.
    fn config(&self) -> &Config;
    /// Records (compactions are stored through it).
    fn store(&self) -> &Store;
    /// Token estimates.
    fn tokens(&self) -> &Arc<TokenCounter>;
    /// Stored compactions and running compaction jobs.
    fn compactions(&self) -> &Compactions;
    /// Where compactions, fallbacks and summary costs are counted.
    fn metrics(&self) -> &Metrics;
    /// The client that calls the summarizer.
    fn summarizer(&self) -> &Upstream;
    /// The limits of a model, its window as the upstream told it.
    fn model_limits(&self, model: &str) -> ModelLimits;
}

/// Reads a compaction's body from the store, by id.
pub type LoadCompaction = Arc<dyn Fn(&str) -> Option<Compaction> + Send + Sync>;

/// The compaction bodies used lately, and how to read the others.
struct Bodies {
    recent: Generations<String, Arc<Compaction>>,
    load: Option<LoadCompaction>,
}

impl Default for Bodies {
    fn default() -> Self {
        Self {
            recent: Generations::new(BODIES),
            load: None,
        }
    }
}

/// The registry of stored compactions and running jobs.
#[derive(Default)]
pub struct Compactions {
    /// Every stored compaction, by tenant and covered chain (without bodies).
    by_tenant: Mutex<HashMap<String, HashMap<ItemHash, Entry>>>,
    /// The same for observe mode's would-be compactions: found only to
    /// figure what a request would have saved, never applied.
    observed: Mutex<HashMap<String, HashMap<ItemHash, Entry>>>,
    jobs: Mutex<HashMap<(String, String), watch::Receiver<bool>>>,
    backoff: Mutex<HashMap<String, Backoff>>,
    /// When each conversation's newest compaction was stored (Unix ms),
    /// and its id.
    newest: Mutex<HashMap<(String, String), (i64, String)>>,
    /// The tenant of every stored compaction, by id (to expand `compaction`
    /// items).
    by_id: Mutex<HashMap<String, String>>,
    bodies: Mutex<Bodies>,
    /// Per conversation: the upstream's token count over the proxy's
    /// estimate, from the last exchange that reported usage. The upstream
    /// may tokenize differently (llama, qwen…); limits are checked in its
    /// tokens.
    /// The recent conversations only: every conversation that reports
    /// usage sets one, one-off requests included.
    calibration: Mutex<Calibrations>,
    /// Conversations whose next request is to be compacted (manual).
    manual: Mutex<foldhash::HashSet<String>>,
    /// Compactions computed here that wait for their first application at
    /// a turn boundary (by id). One this process did not compute (replayed
    /// from the store, stored by another replica) is taken as applied.
    waiting: Mutex<foldhash::HashSet<String>>,
    /// Per (tenant, conversation): the turn (see
    /// [`crate::compaction::agent_tool::turn_of`]) whose agent compaction
    /// was scheduled last (one per turn).
    agent_turns: Mutex<HashMap<(String, String), ItemHash>>,
    /// (tenant, conversation) pairs on Anthropic Messages with thinking on
    /// where an answer followed a round the proxy answered itself.
    hidden_rounds: Mutex<foldhash::HashSet<(String, String)>>,
    /// A store other processes write too: compactions they computed are
    /// looked up there, and computing one is claimed there first.
    shared: Option<Arc<dyn Reads>>,
    /// The recent compaction attempts of the recent conversations, by
    /// (tenant, conversation), oldest first: discarded ones leave no
    /// compaction to show.
    attempts: Mutex<Option<Attempts>>,
    /// Whether each upstream and model offers the provider's compaction
    /// (`compaction.summarizer = "auto"`).
    provider: provider::Support,
}

/// How long a claim on computing a conversation's compaction lasts: past
/// it (a replica died mid-compaction) another may compute it. Longer than
/// a summary takes.
const CLAIM_FOR: Duration = Duration::from_secs(120);

/// How often a request waiting for another replica's compaction looks for it.
const FOREIGN_POLL: Duration = Duration::from_millis(100);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
            self.shared = Some(reads);
        }
        self
    }

    /// Adds a compaction just stored.
    fn insert(&self, c: Arc<Compaction>) {
        self.index(StoredCompaction::from(&*c));
        lock(&self.bodies).recent.insert(c.id.clone(), c);
    }

    fn index(&self, c: StoredCompaction) {
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
    fn body(&self, id: &str) -> Option<Arc<Compaction>> {
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

    fn find_in(
        &self,
        index: &Mutex<HashMap<String, HashMap<ItemHash, Entry>>>,
        tenant: &str,
        chains: &[ItemHash],
        applied: bool,
    ) -> Option<Arc<Compaction>> {
        let (mut id, covered) = {
            let idx = lock(index);
            idx.get(tenant)
                .and_then(|m| rewrite::find(chains, m))
                .map_or((None, 0), |e| (Some(e.id.clone()), e.covered_len))
        };
        // Another replica may have stored one covering more since.
        if let Some(shared) = self.shared.as_ref().filter(|_| applied) {
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
    fn attempted(&self, key: (String, String), attempt: Attempt) {
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

    /// Whether a stored compaction still waits for its first application
    /// at a turn boundary.
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
        lock(&self.agent_turns).insert(key, turn) != Some(turn)
    }

    /// An answer of the conversation followed a round the proxy answered
    /// itself, with thinking on: its thinking is signed against a prefix the
    /// client's history lacks.
    pub fn mark_hidden_round(&self, tenant: &str, conversation: &str) {
        lock(&self.hidden_rounds).insert((tenant.to_string(), conversation.to_string()));
    }

    /// Whether [`Compactions::mark_hidden_round`] was called for the
    /// conversation (in this process).
    pub fn had_hidden_round(&self, tenant: &str, conversation: &str) -> bool {
        lock(&self.hidden_rounds).contains(&(tenant.to_string(), conversation.to_string()))
    }

    /// A background job still computing for this conversation.
    pub fn job(&self, tenant: &str, conversation: &str) -> Option<watch::Receiver<bool>> {
        lock(&self.jobs)
            .get(&(tenant.to_string(), conversation.to_string()))
            .filter(|rx| !*rx.borrow())
            .cloned()
    }

    /// Number of stored compactions.
    pub fn len(&self) -> usize {
        lock(&self.by_tenant).values().map(HashMap::len).sum()
    }

    /// Whether none is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a triggering exchange of `tenant` should be skipped: after
    /// two compactions nothing matched, skip 2, 4, 8… triggers.
    fn backing_off(&self, tenant: &str) -> bool {
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
    fn job_failed(&self, tenant: &str) {
        if let Some(b) = lock(&self.backoff).get_mut(tenant) {
            b.unmatched = b.unmatched.saturating_sub(1);
        }
    }
}

/// Tokens of each item (tokenizer work, off the async threads).
async fn count_items<S: Context>(
    state: &Arc<S>,
    items: Arc<ItemList>,
    known: Option<Arc<Vec<ItemHash>>>,
) -> Result<(Vec<ItemHash>, Vec<u64>), CompactError> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let hashes: Vec<ItemHash> = match known {
            Some(h) if h.len() == items.len() => h.to_vec(),
            _ => items.hashes(),
        };
        let tokens = (0..items.len())
            .map(|i| st.tokens().count_item_with(&hashes[i], || items.item(i)))
            .collect();
        (hashes, tokens)
    })
    .await
    .map_err(|e| CompactError::Internal(e.to_string()))
}

/// Estimated tokens of a request view (`hashes`: its item hashes, when
/// already computed).
pub async fn estimate_view<S: Context>(
    state: &Arc<S>,
    view: Arc<ItemList>,
    hashes: Option<Arc<Vec<ItemHash>>>,
) -> u64 {
    count_items(state, view, hashes)
        .await
        .map(|(_, t)| t.iter().sum())
        .unwrap_or(0)
}

/// Tokens of a request's tool definitions (tokenizer work, off the async
/// threads).
async fn count_tools<S: Context>(state: &Arc<S>, tools: Option<Tools>) -> u64 {
    let Some(t) = tools else {
        return 0;
    };
    let counter = state.tokens().clone();
    tokio::task::spawn_blocking(move || counter.count_item(&t.hash, t.value()))
        .await
        .unwrap_or(0)
}

/// The label of a goal in logs and metrics.
fn goal_kind(goal: Goal) -> &'static str {
    match goal {
        Goal::Shrink => "shrink",
        Goal::HardLimit => "hard_limit",
        Goal::Overflow { .. } => "overflow",
    }
}

/// The tokens the items of a compacted request may take, in the proxy's
/// estimate: the goal's limit in the upstream's tokens, scaled by what the
/// upstream reported for this conversation, less the tool definitions. An
/// overflow answer that states the refused size calibrates the scale first.
fn items_limit<S: Context>(state: &Arc<S>, input: &Input, before: u64, tools_tokens: u64) -> u64 {
    let limits = state.model_limits(&input.model);
    let (tenant, conversation) = (input.tenant.as_str(), input.conversation.as_str());
    let sent = before + tools_tokens;
    let upstream_limit = match input.goal {
        Goal::Shrink => return (before as f64 * (1.0 - FIT_MARGIN)) as u64,
        Goal::HardLimit => hard_limit(&limits),
        Goal::Overflow { stated, max_output } => {
            // A figure far off the estimate is a canned or garbled message,
            // not this request's size.
            let ratio = stated.requested.unwrap_or(0) as f64 / sent.max(1) as f64;
            if let Some(requested) = stated.requested {
                if (MIN_CALIBRATION..=MAX_CALIBRATION).contains(&ratio) {
                    state
                        .compactions()
                        .calibrate(tenant, conversation, requested, sent);
                }
            }
            let calibration = state.compactions().calibration(tenant, conversation);
            let refused = (sent as f64 * calibration).ceil() as u64;
            fit_limit(stated, &limits, max_output, Some(refused))
        }
    };
    let calibration = state.compactions().calibration(tenant, conversation);
    ((upstream_limit as f64 / calibration) as u64).saturating_sub(tools_tokens)
}

/// The largest share of a compaction's limit, as a divisor, that a plan
/// keeps for the facts summary before it settles for the summary's floor.
const FACTS_SHARE_OF_LIMIT: u64 = 3;

/// Computes a compaction for `input`, stores it and makes it apply to later
/// requests. Logs one event with the figures; the outcome is kept with the
/// conversation's recent [`Attempt`]s.
pub async fn compact<S: Context>(
    state: &Arc<S>,
    input: Input,
) -> Result<Arc<Compaction>, CompactError> {
    let key = (input.tenant.clone(), input.conversation.clone());
    let result = compute(state, input).await;
    state.compactions().attempted(key, Attempt::of(&result));
    result
}

/// How a compaction attempt ended, as the admin API reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Attempt {
    /// Unix ms it ended.
    pub at_ms: i64,
    /// `applied`, `discarded` (it would not have shrunk the request) or
    /// `failed`.
    pub result: &'static str,
    /// Estimated tokens of the request before.
    pub tokens_before: Option<u64>,
    /// Estimated tokens after (what a discarded one would have sent).
    pub tokens_after: Option<u64>,
    /// The rung, when applied.
    pub rung: Option<&'static str>,
    /// The compaction stored, when applied.
    pub compaction: Option<String>,
    /// Why it failed.
    pub error: Option<String>,
}

impl Attempt {
    /// A stored compaction as the attempt that made it (computed by
    /// another replica, whose attempts this one does not hold).
    pub fn stored(c: &Compaction) -> Self {
        Attempt {
            at_ms: c.created_ms,
            result: "applied",
            tokens_before: Some(c.tokens_before),
            tokens_after: Some(c.tokens_after),
            rung: Some(c.rung.as_str()),
            compaction: Some(c.id.clone()),
            error: None,
        }
    }

    /// An attempt another replica kept in the shared store.
    pub fn shared(r: &crate::store::AttemptRecord) -> Self {
        Attempt {
            at_ms: r.at_ms,
            result: if r.result == "discarded" {
                "discarded"
            } else {
                "failed"
            },
            tokens_before: r.tokens_before,
            tokens_after: r.tokens_after,
            rung: None,
            compaction: None,
            error: r.error.clone(),
        }
    }

    /// The attempt as a shared store keeps it, if it stored nothing.
    fn unstored(&self) -> Option<crate::store::AttemptRecord> {
        (self.result != "applied").then(|| crate::store::AttemptRecord {
            at_ms: self.at_ms,
            result: self.result.to_string(),
            tokens_before: self.tokens_before,
            tokens_after: self.tokens_after,
            error: self.error.clone(),
        })
    }

    fn of(result: &Result<Arc<Compaction>, CompactError>) -> Self {
        let mut a = Attempt {
            at_ms: crate::ids::now_ms(),
            result: "failed",
            tokens_before: None,
            tokens_after: None,
            rung: None,
            compaction: None,
            error: None,
        };
        match result {
            Ok(c) => {
                a.result = "applied";
                a.tokens_before = Some(c.tokens_before);
                a.tokens_after = Some(c.tokens_after);
                a.rung = Some(c.rung.as_str());
                a.compaction = Some(c.id.clone());
            }
            Err(CompactError::NoShrink { before, after }) => {
                a.result = "discarded";
                a.tokens_before = Some(*before);
                a.tokens_after = Some(*after);
            }
            Err(e) => a.error = Some(e.to_string()),
        }
        a
    }
}

/// The recent attempts of the recent conversations.
type Attempts = Generations<(String, String), Vec<Attempt>>;

/// Attempts kept per conversation, the latest.
const ATTEMPTS_KEPT: usize = 32;

/// Conversations whose attempts are kept, per generation.
const ATTEMPT_CONVERSATIONS: usize = 4096;

async fn compute<S: Context>(
    state: &Arc<S>,
    input: Input,
) -> Result<Arc<Compaction>, CompactError> {
    let started = Instant::now();
    let limits = state.model_limits(&input.model);
    let params = Params::new(&state.config().compaction, &limits);
    let mut input = input;
    if input.observe {
        // What the request would have been with the would-be compaction
        // before: the new one extends it, as it would in auto mode.
        if let Some(b) = &input.base {
            input.view = Arc::new(rewrite::rewrite(&input.view.values(), b).into());
        }
    }
    let input = input;
    let (hashes, mut tokens) = count_items(state, input.view.clone(), None).await?;
    let tools_tokens = count_tools(state, input.tools.clone()).await;
    let values = input.view.values();
    let view: &[Value] = &values;
    // The provider does not read what precedes its compaction item.
    crate::compaction::boundary::count_from_boundary(view, &mut tokens);
    let tokens = tokens;
    let base = input.base.as_deref();
    let before: u64 = tokens.iter().sum();
    let limit = items_limit(state, &input, before, tools_tokens);
    let counter = state.tokens().clone();
    let count = move |v: &Value| counter.count_item(&item_hash(v), v);

    // The cheap rungs first: they cost no model call.
    // The model's notes of what to keep go in a summary: no cheap rung.
    let cheap = (!input.whole && input.keep.is_none())
        .then(|| prepare(view, &tokens, base, &params))
        .flatten()
        .and_then(|prepared| {
            let p = Params {
                target_tokens: params.target_tokens.min(limit),
                ..params
            };
            let (rung, replacement, after) = cheap_rungs(view, &hashes, &prepared, &p, &count)?;
            let applied = fit::Applied {
                covered_len: prepared.covered_len,
                tail_len: view.len() - prepared.cut,
                replacement,
                after,
                kept_users: 0,
            };
            Some((rung, prepared, applied))
        });
    // The summary came from the provider's compaction.
    let mut by_provider = false;
    let (rung, prepared, applied, summary_text, facts, cost, step) = match cheap {
        Some((rung, prepared, applied)) => (
            rung,
            prepared,
            applied,
            None,
            base.and_then(|b| b.facts.clone()),
            SummaryCost::default(),
            None,
        ),
        None => 'summary: {
            // Decided from the counts before a summarizer call is paid for:
            // the facts of everything after the leading items bound the
            // smallest summary of any cut.
            let lead = crate::compaction::items::leading_system(view)
                .max(crate::compaction::boundary::floor(view));
            let widest = summary::extract_facts(&view[lead..], base.and_then(|b| b.facts.as_ref()));
            let floor = fit::summary_floor(&widest, view.len(), &count);
            let fit_input = FitInput {
                view,
                tokens: &tokens,
                hashes: &hashes,
                base,
                limit,
                whole: input.whole,
                summary_floor: floor,
            };
            // Facts first: plan with room for the whole facts summary (at most
            // a third of the limit), so that the tail's bulk is cut before
            // the facts are; only when no plan leaves that much, with the
            // summary at its floor.
            let wanted = fit::summary_wanted(&widest, view.len(), params.summary_max_bytes, &count)
                .min(limit / FACTS_SHARE_OF_LIMIT)
                .max(floor);
            let roomy = FitInput {
                summary_floor: wanted,
                ..fit_input
            };
            let planned = fit::plan(&roomy, &params, &count)
                .or_else(|_| fit::plan(&fit_input, &params, &count));
            let plan = match planned {
                Ok(plan) => plan,
                Err(e) => {
                    let calibration = state
                        .compactions()
                        .calibration(&input.tenant, &input.conversation);
                    let upstream = |t: u64| (t as f64 * calibration).ceil() as u64;
                    let e = CannotFit {
                        core: upstream(e.core + tools_tokens),
                        limit: upstream(e.limit + tools_tokens),
                    };
                    state.metrics().unfittable(goal_kind(input.goal));
                    tracing::warn!(
                        conversation = %input.conversation, core = e.core, limit = e.limit,
                        tools_tokens, goal = goal_kind(input.goal),
                        "no compaction can fit: system items, tools, the newest user message and the pending tool batch alone are over the limit; no summarizer call made"
                    );
                    return Err(e.into());
                }
            };
            let prepared = plan.prepared.clone();
            let part = &view[prepared.lead..prepared.cut];
            let facts = summary::extract_facts(part, base.and_then(|b| b.facts.as_ref()));
            // Observe mode pays for no summary unless told to: the rung is
            // the summary's, its size the facts' plus the answer it would
            // have asked for (see below).
            let estimate = input.observe && !state.config().compaction.observe_summaries;
            let delegated = if !input.observe && provider::wanted(state, &input) {
                let rung = provider::Rung {
                    view,
                    tokens: &tokens,
                    hashes: &hashes,
                    plan: &plan,
                    params: &params,
                    facts: &facts,
                    limit,
                    base,
                };
                provider::summary_rung(state, &input, rung, &count).await
            } else {
                None
            };
            if let Some(d) = delegated {
                by_provider = true;
                break 'summary (
                    Rung::Summary,
                    prepared,
                    d.applied,
                    Some(d.facts_text),
                    Some(facts),
                    d.cost,
                    Some(plan.step),
                );
            }
            let (narrative, cost) = if estimate {
                (None, SummaryCost::default())
            } else {
                summarize(state, &input, part, &params).await
            };
            let rung = if narrative.is_some() || estimate {
                Rung::Summary
            } else {
                Rung::Fallback
            };
            let text = fit::fitted_summary(
                &facts,
                narrative.as_deref(),
                prepared.covered_len,
                params.summary_max_bytes,
                plan.summary_budget,
                &count,
            );
            let text = match input.keep.as_deref() {
                Some(notes) => summary::with_notes(
                    &text,
                    facts.task.as_deref(),
                    &crate::compaction::agent_tool::keep_section(notes),
                ),
                None => text,
            };
            let mut applied = fit::apply(&fit_input, &plan, &params, text.clone(), &count);
            if estimate {
                let facts_only = count(&crate::compaction::items::user_message(text.clone()));
                let room = plan.summary_budget.saturating_sub(facts_only);
                applied.after += params.summary_output_tokens.min(room);
            }
            (
                rung,
                prepared,
                applied,
                Some(text),
                Some(facts),
                cost,
                Some(plan.step),
            )
        }
    };
    let after = applied.after;
    if after >= prepared.before || after > limit {
        let err = CompactError::NoShrink {
            before: prepared.before,
            after,
        };
        tracing::warn!(conversation = %input.conversation, rung = rung.as_str(), limit, error = %err, "compaction discarded");
        return Err(err);
    }
    let kept_users = applied.kept_users;
    let mut prepared = prepared;
    prepared.covered_len = applied.covered_len;
    let mut reason = match step {
        Some(s) if s != fit::Step::Ladder => format!("{}; escalated: {}", input.reason, s.as_str()),
        _ => input.reason.clone(),
    };
    if by_provider {
        reason.push_str("; ");
        reason.push_str(crate::compaction::provider::PROVIDER_REASON);
    }
    if input.observe {
        reason.push_str("; observed");
        if rung == Rung::Summary && cost.calls == 0 {
            reason.push_str(", summary size estimated without a summarizer call");
        }
    }
    // The summary rungs extracted the facts already; the cheap rungs did not.
    let extracted;
    let audit_facts = match summary_text.as_ref().and(facts.as_ref()) {
        Some(f) => f,
        None => {
            let compacted = view.len() - applied.tail_len;
            extracted = summary::extract_facts(
                &view[prepared.lead..prepared.cut.min(compacted)],
                base.and_then(|b| b.facts.as_ref()),
            );
            &extracted
        }
    };
    let tail_len = applied.tail_len;
    let audited = audit(view, &hashes, audit_facts, applied, &count, {
        let ceiling = match input.goal {
            Goal::Shrink => limit.min(params.target_tokens.max(after)),
            _ => limit,
        };
        ceiling.min(prepared.before.saturating_sub(1)).max(after)
    });
    let after = audited.after;
    // A cheap rung over an earlier summary restores facts into that
    // summary's message, which stays the earlier compaction's text.
    let summary_text = summary_text.map(|t| audited.summary.unwrap_or(t));
    let replacement = match input.api {
        // A valid start of a Messages request (see `wire::messages`).
        // A provider compaction block and what precedes it go as sent; the
        // provider's own window is one already, its kept turns as they came.
        Api::Messages if !by_provider => {
            // The replacement starts with the view's items up to the lead.
            let keep = match crate::compaction::boundary::floor(&audited.replacement) {
                0 => 0,
                _ => prepared.lead,
            };
            crate::wire::messages::finish_replacement_after(
                audited.replacement,
                keep,
                crate::compaction::items::is_summary,
            )
        }
        _ => audited.replacement,
    };
    let covered_chain = input.chains[prepared.covered_len - 1];
    let items_kept = prepared.lead + kept_users + tail_len;
    let c = Compaction {
        id: crate::ids::new_compaction_id(),
        tenant: input.tenant.clone(),
        conversation: input.conversation.clone(),
        covered_len: prepared.covered_len,
        covered_chain,
        replacement,
        rung,
        reason,
        tokens_before: prepared.before,
        tokens_after: after,
        items_removed: prepared.cut - prepared.lead - kept_users,
        items_kept,
        summary: summary_text,
        facts,
        base: base.map(|b| b.id.clone()),
        summary_calls: cost.calls,
        summary_tokens: cost.tokens,
        summary_output_tokens: cost.output_tokens,
        tokens_saved: (prepared.before - after) + base.map(Compaction::saved).unwrap_or(0),
        observed: input.observe,
        audit: Some(audited.audit),
        duration_ms: started.elapsed().as_millis() as u64,
        created_ms: crate::ids::now_ms(),
    };
    if let Err(e) = state.store().record_compaction(c.clone()).await {
        tracing::error!(error = %e, "compaction not recorded");
    }
    let c = Arc::new(c);
    if input.soft && !c.observed {
        lock(&state.compactions().waiting).insert(c.id.clone());
    }
    state.compactions().insert(c.clone());
    if let (false, Some(trigger)) = (c.observed, crate::metrics::trigger_of(&c.reason)) {
        state.metrics().compaction_trigger(trigger);
    }
    if by_provider && !c.observed {
        state.metrics().provider_compaction();
    }
    if !c.observed {
        state.metrics().compaction(
            c.rung.as_str(),
            crate::metrics::reason_kind(&c.reason),
            c.tokens_before.saturating_sub(c.tokens_after),
        );
    }
    if let (false, Some(a)) = (c.observed, &c.audit) {
        state.metrics().facts_audited(a);
    }
    if c.rung == Rung::Fallback {
        state.metrics().summary_fallback();
    }
    state
        .metrics()
        .summary_cost(cost.calls, cost.tokens, cost.output_tokens);
    tracing::info!(
        compaction = %c.id, conversation = %c.conversation, rung = c.rung.as_str(), reason = %c.reason,
        tokens_before = c.tokens_before, tokens_after = c.tokens_after,
        items_removed = c.items_removed, items_kept = c.items_kept,
        duration_ms = c.duration_ms, summary_bytes = c.summary.as_ref().map(String::len).unwrap_or(0),
        summary_calls = c.summary_calls, summary_tokens = c.summary_tokens,
        summary_chunks_left_to_facts = cost.chunks_skipped, base = c.base.as_deref().unwrap_or(""),
        observed = c.observed,
        "compacted"
    );
    Ok(c)
}

/// The audit of a compaction about to be stored: `facts`, those the proxy
/// extracted from the compacted part, checked against the request it makes (its
/// replacement and the tail sent verbatim after it), the absent ones
/// restored to its facts message within `ceiling` tokens, and the refs of
/// the view's items it does not send as they were.
fn audit(
    view: &[Value],
    hashes: &[ItemHash],
    facts: &summary::Facts,
    applied: fit::Applied,
    count: &dyn Fn(&Value) -> u64,
    ceiling: u64,
) -> summary::Audited {
    let compacted = view.len() - applied.tail_len;
    let sent: std::collections::HashSet<ItemHash> =
        applied.replacement.iter().map(item_hash).collect();
    let removed = hashes[..compacted]
        .iter()
        .filter(|h| !sent.contains(*h))
        .map(crate::compaction::ladder::archive_ref)
        .collect();
    summary::audit_and_repair(
        facts,
        applied.replacement,
        &view[compacted..],
        applied.after,
        ceiling,
        removed,
        count,
    )
}

/// After an exchange: decides from its usage and, past the trigger, starts a
/// background compaction that the next request will find.
pub fn after_exchange<S: Context>(state: &Arc<S>, input: Input, used: u64, estimated: bool) {
    let cfg = &state.config().compaction;
    let limits = state.model_limits(&input.model);
    let d = decide(used, estimated, &limits, cfg.warn_ratio);
    if !d.compact || !cfg.background || input.no_trigger {
        return;
    }
    // The client asked the provider to compact: a summary of the proxy's
    // own now would be a second compaction of the same history. Only the
    // hard limit and an upstream "too long" compact it.
    if input.provider_compaction {
        tracing::debug!(conversation = %input.conversation, "threshold compaction left to the provider the request asks");
        return;
    }
    let key = (input.tenant.clone(), input.conversation.clone());
    // A compaction stored after this request left was not applied to it; the
    // next request will be rewritten and its usage will tell. One the
    // request waited for and was sent with is no such compaction: the usage
    // is already its own.
    if lock(&state.compactions().newest)
        .get(&key)
        .is_some_and(|(t, id)| {
            *t >= input.requested_ms && input.base.as_ref().is_none_or(|b| &b.id != id)
        })
    {
        return;
    }
    let mut jobs = lock(&state.compactions().jobs);
    if jobs.get(&key).is_some_and(|rx| !*rx.borrow()) {
        return;
    }
    if state.compactions().backing_off(&input.tenant) {
        tracing::info!(conversation = %input.conversation, "compaction backed off: earlier compactions were never matched (client rewrites its history)");
        return;
    }
    let (tx, rx) = watch::channel(false);
    jobs.insert(key.clone(), rx);
    drop(jobs);
    let state = state.clone();
    let mut input = input;
    input.reason = format!("threshold: {}", d.reason());
    input.soft = true;
    tokio::spawn(async move {
        let tenant = input.tenant.clone();
        match claim(&state, &input).await {
            Claimed::Yes => {
                if let Err(e) = compact(&state, input.clone()).await {
                    tracing::info!(error = %e, "background compaction produced nothing");
                    state.compactions().job_failed(&tenant);
                }
                release(&state, &input).await;
            }
            Claimed::Elsewhere => {
                tracing::info!(conversation = %input.conversation, "compaction left to the replica that claimed or stored it");
                state.compactions().job_failed(&tenant);
            }
        }
        let _ = tx.send(true);
        let mut jobs = lock(&state.compactions().jobs);
        if jobs.get(&key).is_some_and(|rx| *rx.borrow()) {
            jobs.remove(&key);
        }
    });
}

/// Schedules the compaction the model asked for (`input.reason`,
/// `input.keep` set): computed now in the background, applied at the
/// conversation's next turn boundary. False when a job for the
/// conversation is under way already (it will be applied the same way).
pub fn schedule_agent<S: Context>(state: &Arc<S>, input: Input) -> bool {
    let key = (input.tenant.clone(), input.conversation.clone());
    let mut jobs = lock(&state.compactions().jobs);
    if jobs.get(&key).is_some_and(|rx| !*rx.borrow()) {
        return false;
    }
    let (tx, rx) = watch::channel(false);
    jobs.insert(key.clone(), rx);
    drop(jobs);
    let state = state.clone();
    let mut input = input;
    input.soft = true;
    tokio::spawn(async move {
        if let Claimed::Yes = claim(&state, &input).await {
            if let Err(e) = compact(&state, input.clone()).await {
                tracing::info!(error = %e, "the compaction the model asked for produced nothing");
            }
            release(&state, &input).await;
        }
        let _ = tx.send(true);
        let mut jobs = lock(&state.compactions().jobs);
        if jobs.get(&key).is_some_and(|rx| *rx.borrow()) {
            jobs.remove(&key);
        }
    });
    true
}

/// Whether this process computes the conversation's compaction.
enum Claimed {
    /// It does (a store only it writes: always).
    Yes,
    /// Another replica computes it now, or stored one after the request
    /// that triggered this began (which the next request will find).
    Elsewhere,
}

/// Claims the computing of `input`'s compaction in a shared store: one
/// replica computes it, however many see the trigger.
async fn claim<S: Context>(state: &Arc<S>, input: &Input) -> Claimed {
    let Some(shared) = state.compactions().shared.clone() else {
        return Claimed::Yes;
    };
    let (tenant, conversation) = (input.tenant.clone(), input.conversation.clone());
    let chains = input.chains.clone();
    let applied = input.base.as_ref().map(|b| b.id.clone());
    let claimed = tokio::task::spawn_blocking(move || {
        if !shared.claim(&tenant, &conversation, CLAIM_FOR.as_millis() as i64) {
            return false;
        }
        // Claimed; but another replica may have stored one for this history
        // that the request missed (stored after it looked): the next
        // request, which extends this one, finds it.
        let missed = shared
            .compaction_covering(&tenant, &chains)
            .is_some_and(|c| Some(&c.id) != applied.as_ref());
        if missed {
            shared.release(&tenant, &conversation);
        }
        !missed
    })
    .await
    .unwrap_or(false);
    if claimed {
        Claimed::Yes
    } else {
        Claimed::Elsewhere
    }
}

/// Gives up the claim [`claim`] took.
async fn release<S: Context>(state: &Arc<S>, input: &Input) {
    let Some(shared) = state.compactions().shared.clone() else {
        return;
    };
    let (tenant, conversation) = (input.tenant.clone(), input.conversation.clone());
    let _ = tokio::task::spawn_blocking(move || shared.release(&tenant, &conversation)).await;
}

/// Waits (within `wait`) for a compaction another replica computes for
/// the conversation, if one claimed it: true if one did.
async fn wait_foreign<S: Context>(
    state: &Arc<S>,
    tenant: &str,
    conversation: &str,
    wait: Duration,
) -> bool {
    let Some(shared) = state.compactions().shared.clone() else {
        return false;
    };
    let (t, c) = (tenant.to_string(), conversation.to_string());
    let since = crate::ids::now_ms();
    let probe = move || {
        // A claim granted here means nobody computes one: given up at once.
        if shared.claim(&t, &c, FOREIGN_POLL.as_millis() as i64) {
            shared.release(&t, &c);
            return None;
        }
        Some(
            shared
                .newest_compaction_ms(&t, &c)
                .is_some_and(|ms| ms >= since),
        )
    };
    let deadline = Instant::now() + wait;
    loop {
        let probe = probe.clone();
        match tokio::task::spawn_blocking(probe).await.ok().flatten() {
            None => return false,
            Some(true) => return true,
            Some(false) if Instant::now() >= deadline => return true,
            Some(false) => tokio::time::sleep(FOREIGN_POLL).await,
        }
    }
}

/// Whether a request fits under the hard limit (window minus max output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// It does (or is small enough that it surely does).
    Fits,
    /// It did not, and it waited for the compaction under way.
    Waited,
    /// It does not and nothing is under way: about this many tokens.
    Over(u64),
}

/// A request to check against the hard limit.
pub struct FitCheck<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Conversation.
    pub conversation: &'a str,
    /// Model (for its limits).
    pub model: &'a str,
    /// The items as they would go upstream.
    pub view: Arc<ItemList>,
    /// Their hashes, when already computed.
    pub hashes: Option<Arc<Vec<ItemHash>>>,
    /// The request's tool definitions.
    pub tools: Option<Tools>,
    /// Size of the request body, when it is what goes upstream.
    pub bytes: Option<usize>,
}

/// Checks a request against the hard limit; waits (bounded) for the
/// conversation's compaction under way when it is over. `bytes`, when
/// known, is the size of the request body: a token is at least one byte, so
/// a body no larger than the limit needs no tokenizer. `tools` are the
/// request's tool definitions, which count too. The estimate is scaled by
/// what the upstream reported for this conversation before.
pub async fn check_fit<S: Context>(state: &Arc<S>, req: FitCheck<'_>) -> Fit {
    let FitCheck {
        tenant,
        conversation,
        model,
        view,
        hashes,
        tools,
        bytes,
    } = req;
    let limits = state.model_limits(model);
    let hard = hard_limit(&limits);
    if bytes.is_some_and(|b| b as u64 <= hard) {
        return Fit::Fits;
    }
    let calibration = state.compactions().calibration(tenant, conversation);
    // A long conversation's next request: most items were counted before,
    // the new ones are few. Their bytes bound their tokens; the tokenizer
    // is needed only when that bound does not settle it.
    if let Some(h) = &hashes {
        let bound = state.tokens().bound(&view, h, tools.as_ref());
        if (bound as f64 * calibration).ceil() as u64 <= hard {
            return Fit::Fits;
        }
    }
    let tools_tokens = count_tools(state, tools).await;
    // What the provider reads: from its newest compaction item on.
    let (view, hashes) = match crate::compaction::boundary::newest_in(&view) {
        Some(b) if b > 0 => (
            Arc::new(view.with_prefix_replaced(b, &[])),
            hashes
                .filter(|h| h.len() == view.len())
                .map(|h| Arc::new(h[b..].to_vec())),
        ),
        _ => (view, hashes),
    };
    let estimate = estimate_view(state, view, hashes).await + tools_tokens;
    let tokens = (estimate as f64 * calibration).ceil() as u64;
    if tokens <= hard {
        return Fit::Fits;
    }
    let wait = Duration::from_secs(state.config().compaction.wait_secs);
    let Some(mut rx) = state.compactions().job(tenant, conversation) else {
        if wait_foreign(state, tenant, conversation, wait).await {
            return Fit::Waited;
        }
        return Fit::Over(tokens);
    };
    tracing::info!(
        conversation,
        tokens,
        "request over the hard limit waits for the compaction under way"
    );
    let _ = tokio::time::timeout(wait, rx.wait_for(|done| *done)).await;
    Fit::Waited
}

/// What the summarizer calls of one compaction cost.
#[derive(Debug, Clone, Copy, Default)]
struct SummaryCost {
    /// Calls made.
    calls: u32,
    /// Their tokens, prompt and answer (as reported, else estimated).
    tokens: u64,
    /// Of those, the answers'.
    output_tokens: u64,
    /// Older chunks past the call cap, left to the extracted facts.
    chunks_skipped: usize,
}

/// Runs the summarizer over `part`, chunk by chunk, within
/// `compaction.max_summary_calls`; `None` when the model wrote no
/// usable section for a chunk (after one retry per chunk, if the cap leaves
/// room, which names the sections missing from the first answer).
///
/// Past the cap the first chunk (which carries the previous summary, when
/// there is one) and the newest are summarized, and the chunks between are
/// left to the deterministic facts, which the summary always carries: what
/// happened last is what the next turn needs most. A cap of 0 makes every
/// summary the facts alone.
async fn summarize<S: Context>(
    state: &Arc<S>,
    input: &Input,
    part: &[Value],
    params: &Params,
) -> (Option<String>, SummaryCost) {
    let lines = summary::render_transcript(part, TRANSCRIPT_ITEM_BYTES);
    let chunks = {
        let counter = state.tokens().clone();
        let budget = params.summary_chunk_tokens;
        tokio::task::spawn_blocking(move || chunk_lines(&lines, budget, |s| counter.count_text(s)))
            .await
            .unwrap_or_default()
    };
    let cap = state.config().compaction.max_summary_calls;
    let run = chunks_within_cap(chunks.len(), cap);
    let mut cost = SummaryCost {
        chunks_skipped: chunks.len() - run,
        ..SummaryCost::default()
    };
    if run == 0 {
        return (None, cost);
    }
    let newest = (chunks.len() - run + 1).max(1);
    let mut narrative: Option<String> = None;
    for chunk in chunks[..1].iter().chain(&chunks[newest..]) {
        let mut messages = summary::summarizer_messages(narrative.as_deref(), chunk);
        // The answer with the most sections written; a partial one is kept
        // (the assembled summary fills the missing sections from the facts).
        let mut got: Option<(usize, String)> = None;
        for _attempt in 0..2 {
            if cost.calls >= cap {
                break;
            }
            cost.calls += 1;
            match call_summarizer(state, input, &messages, params).await {
                Ok((text, tokens, output_tokens)) => {
                    cost.tokens += tokens;
                    cost.output_tokens += output_tokens;
                    match summary::validate(&text) {
                        Ok(()) => {
                            got = Some((summary::NARRATIVE_SECTIONS.len(), text));
                            break;
                        }
                        Err(missing) => {
                            state.metrics().summary_failure();
                            tracing::warn!(?missing, "summary lacks mandatory sections");
                            let written = summary::usable(&text);
                            if written > 0 && got.as_ref().is_none_or(|(n, _)| written >= *n) {
                                got = Some((written, text));
                            }
                            messages =
                                summary::retry_messages(narrative.as_deref(), chunk, &missing);
                        }
                    }
                }
                Err(e) => {
                    state.metrics().summary_failure();
                    tracing::warn!(error = %e, "summary call failed")
                }
            }
        }
        match got {
            Some((_, t)) => narrative = Some(t),
            None => return (None, cost),
        }
    }
    (narrative, cost)
}

/// How many of `chunks` to summarize under a cap of `cap` calls: one call
/// each, with a quarter of the cap kept for retries.
fn chunks_within_cap(chunks: usize, cap: u32) -> usize {
    let cap = cap as usize;
    chunks.min(cap - cap / 4)
}

/// Groups transcript lines into chunks of at most `budget` tokens (a single
/// longer line is its own chunk).
pub fn chunk_lines(lines: &[String], budget: u64, count: impl Fn(&str) -> u64) -> Vec<String> {
    let mut chunks = Vec::new();
    let mut cur = String::new();
    let mut used = 0;
    for line in lines {
        let t = count(line);
        if !cur.is_empty() && used + t > budget {
            chunks.push(std::mem::take(&mut cur));
            used = 0;
        }
        cur.push_str(line);
        cur.push('\n');
        used += t;
    }
    if !cur.is_empty() {
        chunks.push(cur);
    }
    chunks
}

/// Bytes of a summarizer's error answer kept in the log line.
const MAX_LOGGED_ERROR: usize = 300;

/// Why a summarizer call gave no text. Every kind is tried again once by
/// `summarize` (a refusal may be a passing overload, an empty answer a
/// sampling accident); past that the summary falls back to the facts.
#[derive(Debug, thiserror::Error)]
pub enum SummarizerError {
    /// The call could not be made or its answer read (its URL, the
    /// connection, a timeout).
    #[error(transparent)]
    Upstream(#[from] crate::error::ProxyError),
    /// The request could not be encoded.
    #[error("summary request: {0}")]
    Encode(#[source] serde_json::Error),
    /// The summarizer refused: its status and answer, redacted and cut.
    #[error("summarizer answered {status}: {shown}")]
    Refused {
        /// The answer's status.
        status: http::StatusCode,
        /// The start of its body, credentials redacted.
        shown: String,
    },
    /// The answer is not JSON.
    #[error("summarizer answer is not JSON: {0}")]
    Decode(#[source] serde_json::Error),
    /// The answer holds no message text.
    #[error("summarizer answer has no message content")]
    NoContent,
}

/// One summarizer call: the answer's text, the call's tokens and of those
/// the answer's (as the upstream reports them, else estimated).
async fn call_summarizer<S: Context>(
    state: &Arc<S>,
    input: &Input,
    messages: &[Value],
    params: &Params,
) -> Result<(String, u64, u64), SummarizerError> {
    let cfg = &state.config().compaction;
    let model = if cfg.summarizer_model.is_empty() {
        input.model.as_str()
    } else {
        cfg.summarizer_model.as_str()
    };
    let mut body = match input.api {
        // Anthropic Messages: the system prompt is a top-level field.
        Api::Messages => json!({
            "model": model,
            "max_tokens": params.summary_output_tokens,
            "system": messages.iter().find(|m| m["role"] == "system").map(|m| m["content"].clone()),
            "messages": messages.iter().filter(|m| m["role"] != "system").collect::<Vec<_>>(),
            "stream": false,
        }),
        _ => json!({"model": model, "messages": messages, "stream": false}),
    };
    if input.api != Api::Messages {
        // Reasoning-model families reject `max_tokens`.
        let lower = model.to_ascii_lowercase();
        let key = if lower.starts_with('o')
            && lower.chars().nth(1).is_some_and(|c| c.is_ascii_digit())
            || lower.starts_with("gpt-5")
        {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        body[key] = json!(params.summary_output_tokens);
    }
    let mut headers = input.auth.clone();
    if input.api == Api::Messages {
        // The API refuses a request without a version; the client's was not kept.
        headers
            .entry("anthropic-version")
            .or_insert(http::HeaderValue::from_static(ANTHROPIC_VERSION));
        state.summarizer().key_as_x_api_key(&mut headers);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    let url = state.summarizer().url(input.api.summary_endpoint(), None)?;
    let bytes = bytes::Bytes::from(serde_json::to_vec(&body).map_err(SummarizerError::Encode)?);
    let resp = state
        .summarizer()
        .send_bytes(http::Method::POST, &url, headers, bytes)
        .await?;
    let status = resp.status();
    let body = state.summarizer().read_body(resp).await?;
    if !status.is_success() {
        // Redacted whole, then cut: a cut first could leave part of a key.
        let text = String::from_utf8_lossy(&body);
        let text = state.summarizer().redact(&text, &input.auth);
        let shown = &text[..crate::compaction::items::floor_boundary(&text, MAX_LOGGED_ERROR)];
        return Err(SummarizerError::Refused {
            status,
            shown: shown.to_string(),
        });
    }
    let v: Value = serde_json::from_slice(&body).map_err(SummarizerError::Decode)?;
    let text = match input.api {
        Api::Messages => crate::wire::messages::answer_text(&v),
        _ => v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .map(String::from),
    }
    .ok_or(SummarizerError::NoContent)?;
    let reported = match input.api.usage(&v) {
        Some(u) if input.api == Api::Messages => (Some(u.total()), Some(u.output_tokens)),
        _ => (
            v.pointer("/usage/total_tokens").and_then(Value::as_u64),
            v.pointer("/usage/completion_tokens")
                .and_then(Value::as_u64),
        ),
    };
    let (tokens, output) = match reported {
        (Some(t), Some(out)) => (t, out.min(t)),
        (total, _) => {
            let counter = state.tokens().clone();
            let all: String = messages
                .iter()
                .filter_map(|m| m.get("content").and_then(Value::as_str))
                .chain([text.as_str()])
                .collect();
            let answer = text.clone();
            let (all, answer) = tokio::task::spawn_blocking(move || {
                (counter.count_text(&all), counter.count_text(&answer))
            })
            .await
            .unwrap_or((0, 0));
            let tokens = total.unwrap_or(all);
            (tokens, answer.min(tokens))
        }
    };
    Ok((text, tokens, output))
}

/// The `anthropic-version` a summary call through Anthropic Messages sends.
const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The credential headers of a request (kept in memory for the summarizer).
pub fn auth_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in crate::redact::CREDENTIAL_HEADERS {
        if let Some(v) = headers.get(name) {
            let mut v = v.clone();
            v.set_sensitive(true);
            if let Ok(n) = http::HeaderName::from_bytes(name.as_bytes()) {
                out.insert(n, v);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn the_call_cap_bounds_the_chunks_summarized() {
        assert_eq!(chunks_within_cap(3, 8), 3);
        assert_eq!(chunks_within_cap(76, 8), 6);
        assert_eq!(chunks_within_cap(5, 1), 1);
        assert_eq!(chunks_within_cap(5, 0), 0);
        assert_eq!(chunks_within_cap(0, 8), 0);
    }

    #[test]
    fn chunks_respect_the_budget() {
        let lines: Vec<String> = ["aaaa", "bb", "cccccc", "d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let chunks = chunk_lines(&lines, 6, |s| s.len() as u64);
        assert_eq!(chunks, vec!["aaaa\nbb\n", "cccccc\n", "d\n"]);
        assert!(chunk_lines(&[], 5, |s| s.len() as u64).is_empty());
    }
}
