//! What was learned of the upstreams and the clients: each conversation's
//! calibration (the upstream's tokens over the proxy's estimate) and last
//! reported prompt, when the upstream last read a prefix, the back-off of
//! tenants whose compactions no request matched, and whether each upstream
//! offers the provider's compaction. One lock.

use foldhash::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::guard::lock;
use crate::bounded::Generations;
use crate::wire::ItemHash;

/// Bounds of the estimate calibration (a wild figure is a misreport).
pub(super) const MIN_CALIBRATION: f64 = 0.5;
pub(super) const MAX_CALIBRATION: f64 = 3.0;
/// Longest back-off, in triggering exchanges skipped.
const MAX_BACKOFF: u32 = 64;

/// Conversations whose calibration is kept, per generation (see
/// [`Generations`]): one that reports usage again within this many others
/// keeps it; past that it starts again from 1 (its next usage sets it).
const CALIBRATED: usize = 1 << 17;

/// Upstreams × models whose answer [`Knowledge::offered`] keeps, and
/// conversations [`Knowledge::refused`], per generation (see
/// [`Generations`]): one not used for longer is asked again.
const SUPPORT_ENTRIES: usize = 4096;

/// What was learned, under the part's lock. The figures per conversation
/// are keyed by a 64-bit hash of the (tenant, conversation) pair under a
/// per-process seed, with no strings to allocate per exchange: two
/// conversations sharing a key (about one chance in 2^64 / 2^18 entries)
/// would share a figure that only scales an estimate, within bounds.
struct Knowledge {
    /// Per conversation: the upstream's token count over the proxy's
    /// estimate, from the last exchange that reported usage. The upstream
    /// may tokenize differently (llama, qwen…); limits are checked in its
    /// tokens. The recent conversations only: every conversation that
    /// reports usage sets one, one-off requests included.
    calibration: Generations<u64, f64>,
    /// Per conversation: its last reported prompt. The recent ones.
    reported: Generations<u64, Reported>,
    /// When the upstream last read a conversation's prefix (an answered
    /// exchange, a summary call that repeated it), and how long its cache
    /// keeps it idle, by a hash of the tenant and the conversation's
    /// thread (see `engine::idle::thread`). The recent ones.
    read_at: Generations<u64, (Instant, Duration)>,
    /// Per tenant: the back-off of its compactions no request matched.
    backoff: HashMap<String, Backoff>,
    /// Per (upstream, model): whether it offers the provider's compaction
    /// (`compaction.summarizer = "auto"`). An upstream that errs otherwise
    /// (5xx, a timeout) teaches nothing and is asked again next time.
    offered: Generations<(String, String), bool>,
    /// Conversations, by (tenant, conversation), whose compacted request
    /// the upstream refused with the provider's window: their summary
    /// rung is local from then on.
    refused: Generations<(String, String), ()>,
}

impl Default for Knowledge {
    fn default() -> Self {
        Self {
            calibration: Generations::new(CALIBRATED),
            reported: Generations::new(CALIBRATED),
            read_at: Generations::new(CALIBRATED),
            backoff: HashMap::default(),
            offered: Generations::new(SUPPORT_ENTRIES),
            refused: Generations::new(SUPPORT_ENTRIES),
        }
    }
}

/// A tenant's back-off.
#[derive(Default)]
struct Backoff {
    /// Compactions registered that no request has matched since.
    unmatched: u32,
    /// Exponent of the next back-off.
    level: u32,
    /// Triggering exchanges still to skip.
    skip: u32,
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

/// What was learned, and the seed of its keys.
#[derive(Default)]
pub(super) struct Learned {
    knowledge: Mutex<Knowledge>,
    seed: foldhash::quality::RandomState,
}

impl Learned {
    fn key(&self, tenant: &str, conversation: &str) -> u64 {
        use std::hash::BuildHasher;
        self.seed.hash_one((tenant, conversation))
    }

    fn thread_key(&self, tenant: &str, thread: &ItemHash) -> u64 {
        use std::hash::BuildHasher;
        self.seed.hash_one((tenant, thread))
    }

    /// Learns how the upstream's token counts compare with the estimate.
    pub(super) fn calibrate(
        &self,
        tenant: &str,
        conversation: &str,
        reported: u64,
        estimated: u64,
    ) {
        if reported == 0 || estimated == 0 {
            return;
        }
        let ratio = (reported as f64 / estimated as f64).clamp(MIN_CALIBRATION, MAX_CALIBRATION);
        let key = self.key(tenant, conversation);
        lock(&self.knowledge).calibration.insert(key, ratio);
    }

    /// Upstream tokens per estimated token for the conversation (1 until
    /// known).
    pub(super) fn calibration(&self, tenant: &str, conversation: &str) -> f64 {
        let key = self.key(tenant, conversation);
        lock(&self.knowledge)
            .calibration
            .get(&key)
            .copied()
            .unwrap_or(1.0)
    }

    /// Keeps the conversation's last reported prompt.
    pub(super) fn report(&self, tenant: &str, conversation: &str, reported: Reported) {
        if reported.input_tokens == 0 {
            return;
        }
        let key = self.key(tenant, conversation);
        lock(&self.knowledge).reported.insert(key, reported);
    }

    /// The conversation's last reported prompt, if it is known here.
    pub(super) fn last_reported(&self, tenant: &str, conversation: &str) -> Option<Reported> {
        let key = self.key(tenant, conversation);
        lock(&self.knowledge).reported.get(&key).copied()
    }

    /// The upstream read the prefix `thread` names now, and keeps it
    /// cached `ttl` while idle.
    pub(super) fn read_now(&self, tenant: &str, thread: &ItemHash, ttl: Duration) {
        let key = self.thread_key(tenant, thread);
        lock(&self.knowledge)
            .read_at
            .insert(key, (Instant::now(), ttl));
    }

    /// Whether the upstream's cache of the prefix `thread` names has
    /// expired (or was never seen read).
    pub(super) fn cache_expired(&self, tenant: &str, thread: &ItemHash) -> bool {
        let key = self.thread_key(tenant, thread);
        lock(&self.knowledge)
            .read_at
            .renew(&key)
            .is_none_or(|(at, ttl)| at.elapsed() > *ttl)
    }

    /// Whether a triggering exchange of `tenant` should be skipped: after
    /// two compactions nothing matched, skip 2, 4, 8… triggers.
    pub(super) fn backing_off(&self, tenant: &str) -> bool {
        let mut knowledge = lock(&self.knowledge);
        let b = knowledge.backoff.entry(tenant.to_string()).or_default();
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
        if let Some(b) = lock(&self.knowledge).backoff.get_mut(tenant) {
            b.unmatched = b.unmatched.saturating_sub(1);
        }
    }

    /// A request of `tenant` matched a compaction: its back-off is over.
    pub(super) fn matched(&self, tenant: &str) {
        if let Some(b) = lock(&self.knowledge).backoff.get_mut(tenant) {
            *b = Backoff::default();
        }
    }

    /// Whether the upstream and model `key` offer the provider's
    /// compaction, if learned.
    pub(super) fn offered(&self, key: &(String, String)) -> Option<bool> {
        lock(&self.knowledge).offered.renew(key).copied()
    }

    /// Learns whether the upstream and model `key` offer the provider's
    /// compaction.
    pub(super) fn learn_offered(&self, key: (String, String), offered: bool) {
        let before = lock(&self.knowledge).offered.insert(key.clone(), offered);
        if before != Some(offered) {
            tracing::info!(
                upstream = %key.0, model = %key.1, offered,
                "learned whether the upstream compacts for the summary rung"
            );
        }
    }

    /// Whether the conversation's summary rung is local since the
    /// upstream refused its request compacted by the provider.
    pub(super) fn provider_refused(&self, key: &(String, String)) -> bool {
        lock(&self.knowledge).refused.renew(key).is_some()
    }

    /// The upstream refused the conversation's request compacted by the
    /// provider.
    pub(super) fn refuse_provider(&self, key: (String, String)) {
        lock(&self.knowledge).refused.insert(key, ());
    }
}
