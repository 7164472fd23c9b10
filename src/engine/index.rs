//! The compactions this process knows, in memory, and what it keeps beside
//! them: one registry of owned parts, each behind one lock of its own (or
//! none), each with methods and no fields shown to its siblings.
//!
//! - [`Stored`]: what is stored (by tenant, by id, bodies, newest);
//! - [`Heard`]: what a store shared by replicas announced;
//! - [`Running`]: what is running (jobs, follow-ups, manual, waiting, idle
//!   watches);
//! - [`Learned`]: what was learned (calibration, reports, cache reads,
//!   back-off, provider support);
//! - [`Turns`]: per-turn bookkeeping (agent turns, hidden rounds);
//! - [`Attempts`]: how the recent compaction attempts ended.
//!
//! Lock order: a part's method holds its lock only while it runs, and
//! calls no other part meanwhile, but for one: [`Running::start`] runs its
//! check (the back-off, [`Learned`]'s lock) under [`Running`]'s lock, and
//! [`Learned`] never calls [`Running`]. So at most those two locks are held
//! at once, always in that order.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::attempt::{Attempt, Attempts};
use super::heard::Heard;
use super::learned::{Learned, Reported};
use super::running::Running;
use super::stored::{LoadCompaction, Stored};
use super::turns::Turns;
use crate::compaction::Compaction;
use crate::conversation::ConversationIndex;
use crate::store::StoredCompaction;
use crate::store::{ChainHit, LookUp, Reads, StoreError};
use crate::wire::ItemHash;

/// The registry of stored compactions and running jobs.
#[derive(Default)]
pub struct Compactions {
    /// What is stored: every compaction, by tenant and covered chain, its
    /// tenant by id, each conversation's newest, the bodies used lately.
    stored: Stored,
    /// What other processes stored, as a shared store announced it, and
    /// which conversations and requests the store was asked for.
    heard: Heard,
    /// What is running: the jobs and their follow-ups, the manual
    /// compactions asked for, the compactions waiting for their first
    /// application, the idle conversations watched.
    running: Running,
    /// What was learned: calibrations, reported prompts, cache reads,
    /// back-off, provider support.
    learned: Learned,
    /// Per-turn bookkeeping: agent turns, hidden rounds.
    turns: Turns,
    /// The recent compaction attempts of the recent conversations.
    attempts: Attempts,
    /// A store other processes write too: compactions they computed are
    /// looked up there, computing one is claimed there first, and manual
    /// requests and attempts are kept there. Set once, before any request.
    shared: Option<Arc<dyn Reads>>,
}

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

impl Compactions {
    /// Rebuilds the registry from the stored compactions (replay); `load`
    /// reads a body from the store when a request needs one.
    pub fn from_stored(list: Vec<StoredCompaction>, load: LoadCompaction) -> Self {
        let me = Self {
            stored: Stored::reading(load),
            ..Self::default()
        };
        for c in list {
            me.stored.index(c);
        }
        me
    }

    /// The registry over a store other processes write too (see
    /// [`Reads::shared`]).
    pub fn shared_with(mut self, reads: Arc<dyn Reads>) -> Self {
        if reads.shared() {
            reads.on_compacted(Box::new(self.heard.announcer()));
            self.shared = Some(reads);
        }
        self
    }

    /// What is stored.
    pub(super) fn stored(&self) -> &Stored {
        &self.stored
    }

    /// What is running.
    pub(super) fn running(&self) -> &Running {
        &self.running
    }

    /// What was learned.
    pub(super) fn learned(&self) -> &Learned {
        &self.learned
    }

    /// The store other processes write too, if any.
    pub(super) fn shared(&self) -> Option<&Arc<dyn Reads>> {
        self.shared.as_ref()
    }

    /// Indexes the compactions announced since the last call (those this
    /// process did not store itself).
    fn take_announced(&self) {
        for c in self.heard.take_announced() {
            if !self.stored.knows(&c.id) {
                self.stored.index(c);
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
        let (kept, covered) = self.stored.covering(tenant, chains, false);
        // The body of the one memory has, unless kept: read along.
        let body_of = kept.filter(|id| !self.stored.body_kept(id));
        let hearing = shared.hearing();
        let known = conversation.is_some_and(|c| {
            let under = self.heard.asked_under(tenant, c);
            hearing.is_some() && under == hearing
        });
        let covering_from = (!known && covered < chains.len()).then_some(covered);
        let ask = LookUp {
            prefix_from,
            covering_from,
            body_of: body_of.clone(),
            goes_on,
        };
        self.heard.settle(tenant, *last);
        let found = shared.look_up(tenant, chains, ask).await;
        if let Some(c) = found.compaction {
            if Some(&c.id) == body_of.as_ref() {
                self.stored.keep_body(Arc::new(c));
            } else if c.covered_len > covered && c.covers(chains) {
                self.stored.insert(Arc::new(c));
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
            self.heard.asked(tenant, conversation, under);
        }
    }

    /// Adds a compaction just stored.
    pub(super) fn insert(&self, c: Arc<Compaction>) {
        self.stored.insert(c);
    }

    /// The longest stored compaction of `tenant` that covers a prefix of the
    /// request; a match also clears the tenant's back-off.
    pub fn find(&self, tenant: &str, chains: &[ItemHash]) -> Option<Arc<Compaction>> {
        self.find_in(false, tenant, chains)
    }

    /// [`Compactions::find`] among observe mode's would-be compactions
    /// (this replica's own: they are never applied, so never shared).
    pub fn find_observed(&self, tenant: &str, chains: &[ItemHash]) -> Option<Arc<Compaction>> {
        self.find_in(true, tenant, chains)
    }

    fn find_in(
        &self,
        observed: bool,
        tenant: &str,
        chains: &[ItemHash],
    ) -> Option<Arc<Compaction>> {
        self.take_announced();
        let (mut id, covered) = self.stored.covering(tenant, chains, observed);
        // Another replica may have stored one covering more since: asked
        // unless [`Compactions::prefetch`] just did (then once only: a
        // later lookup of the request, after it waited or before it is
        // compacted, asks).
        let settled = chains
            .last()
            .is_some_and(|last| self.heard.take_settled(tenant, *last));
        if let Some(shared) = self.shared.as_ref().filter(|_| !observed && !settled) {
            let longer = &chains[covered.min(chains.len())..];
            if let Some(c) = shared.compaction_covering(tenant, longer) {
                if c.covered_len > covered
                    && crate::compaction::covers_prefix(chains, c.covered_len, &c.covered_chain)
                {
                    id = Some(c.id.clone());
                    self.stored.index(c);
                }
            }
        }
        let found = self.stored.body(&id?);
        if found.is_some() {
            self.learned.matched(tenant);
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
        self.attempts.push(key, attempt);
    }

    /// The conversation's recent attempts, oldest first (those of a
    /// conversation not seen for long are forgotten).
    pub fn attempts(&self, tenant: &str, conversation: &str) -> Vec<Attempt> {
        self.attempts.of(tenant, conversation)
    }

    /// Forgets `tenant`'s compactions `ids` (their conversation was
    /// deleted): no request is rewritten by them any more.
    pub fn forget(&self, tenant: &str, ids: &[String]) {
        // Observe mode's would-be compactions go too: a deleted one would
        // still be offered as what a request would have saved.
        self.stored.forget(tenant, ids);
    }

    /// A stored compaction by id, only if it belongs to `tenant` (and was
    /// applied, not observed).
    pub fn get(&self, tenant: &str, id: &str) -> Option<Arc<Compaction>> {
        if self.stored.belongs(id, tenant) {
            self.stored.body(id).filter(|c| !c.observed)
        } else {
            None
        }
    }

    /// Learns how the upstream's token counts compare with the estimate.
    pub fn calibrate(&self, tenant: &str, conversation: &str, reported: u64, estimated: u64) {
        self.learned
            .calibrate(tenant, conversation, reported, estimated);
    }

    /// Keeps the conversation's last reported prompt (see [`Reported`]).
    pub fn report(&self, tenant: &str, conversation: &str, reported: Reported) {
        self.learned.report(tenant, conversation, reported);
    }

    /// The conversation's last reported prompt, if it is known here.
    pub fn last_reported(&self, tenant: &str, conversation: &str) -> Option<Reported> {
        self.learned.last_reported(tenant, conversation)
    }

    /// Upstream tokens per estimated token for the conversation (1 until known).
    pub fn calibration(&self, tenant: &str, conversation: &str) -> f64 {
        self.learned.calibration(tenant, conversation)
    }

    /// Asks for the conversation's next request to be compacted, like
    /// Codex's `/compact`. The proxy needs that request's credentials for
    /// the summary, so it happens then. False if already asked. With a
    /// shared store the request is recorded there, so whichever process
    /// serves that request honours it.
    pub fn request_manual(&self, conversation: &str) -> Result<bool, StoreError> {
        match &self.shared {
            Some(shared) => shared.request_manual(conversation),
            None => Ok(self.running.ask_manual(conversation)),
        }
    }

    /// Whether a manual compaction of the conversation waits for its next
    /// request (with a shared store, whichever process was asked).
    pub fn manual_pending(&self, conversation: &str) -> Result<bool, StoreError> {
        match &self.shared {
            Some(shared) => shared.manual_pending(conversation),
            None => Ok(self.running.manual_pending(conversation)),
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
            None => self.running.take_manual(conversation),
        }
    }

    /// The upstream read the prefix of the conversation `thread` names
    /// (see `engine::idle::thread`) now, and keeps it cached `ttl` while
    /// idle.
    pub fn read_now(&self, tenant: &str, thread: &ItemHash, ttl: Duration) {
        self.learned.read_now(tenant, thread, ttl);
    }

    /// Whether the upstream's cache of the conversation's prefix has
    /// expired: idle past its lifetime since the upstream last read it.
    /// One this process never saw read (or forgot) is taken as expired.
    pub fn cache_expired(&self, tenant: &str, thread: &ItemHash) -> bool {
        self.learned.cache_expired(tenant, thread)
    }

    /// Whether a stored compaction still waits for its first application
    /// (the model's own: at a turn boundary).
    pub fn is_waiting(&self, id: &str) -> bool {
        self.running.is_waiting(id)
    }

    /// A compaction is applied to a request: true if this is its first
    /// application after it waited (from then on every request that extends
    /// its prefix gets it).
    pub fn first_applied(&self, id: &str) -> bool {
        self.running.first_applied(id)
    }

    /// The model asked for a compaction in `turn` of the conversation:
    /// true if it is the first request of that turn to ask (one per turn).
    pub fn schedule_agent_turn(&self, tenant: &str, conversation: &str, turn: ItemHash) -> bool {
        self.turns.schedule_agent_turn(tenant, conversation, turn)
    }

    /// An answer of the conversation followed a round the proxy answered
    /// itself, with thinking on: its thinking is signed against a prefix the
    /// client's history lacks.
    pub fn mark_hidden_round(&self, tenant: &str, conversation: &str) {
        self.turns.mark_hidden_round(tenant, conversation);
    }

    /// Whether [`Compactions::mark_hidden_round`] was called for the
    /// conversation (in this process).
    pub fn had_hidden_round(&self, tenant: &str, conversation: &str) -> bool {
        self.turns.had_hidden_round(tenant, conversation)
    }

    /// A background job still computing for this conversation.
    pub fn job(&self, tenant: &str, conversation: &str) -> Option<watch::Receiver<bool>> {
        self.running
            .job(&(tenant.to_string(), conversation.to_string()))
    }

    /// How many background jobs are computing now (any conversation).
    pub fn jobs_under_way(&self) -> usize {
        self.running.jobs_under_way()
    }

    /// Number of stored compactions.
    pub fn len(&self) -> usize {
        self.take_announced();
        self.stored.len()
    }

    /// Whether none is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::super::attempt::ATTEMPTS_KEPT;
    use super::super::error::CompactError;
    use super::super::stored::BODIES;
    use super::*;
    use foldhash::HashMap;
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
        assert!(registry.stored.bodies_kept() <= 2 * BODIES);
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
