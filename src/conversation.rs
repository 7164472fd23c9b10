//! Which conversation a request belongs to.
//!
//! Stateless APIs resend the whole history every turn, so a request is
//! matched to a known conversation by content: the chained hash of each of
//! its prefixes is looked up among the prefixes recorded for earlier
//! exchanges of the same tenant; the longest match that continues its
//! conversation wins. A request continues a conversation when it extends
//! one of the conversation's recent tips (an exchange no later one
//! extended), retries one that was not answered whole, or sends a tip
//! again whole when it holds an answer of the model (a client that lost the
//! answer); one that only repeats an older prefix, or an opening, as every
//! session that opens with the same first message does, starts a
//! conversation of its own. Explicit ids
//! (`session-id`, `prompt_cache_key`, our header) and `previous_response_id`
//! take precedence. Everything is keyed by tenant: nothing is ever shared
//! between two credentials, even for byte-identical histories.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::bounded::Generations;

use crate::store::{ChainHit, IndexedExchange, PrefixRef, Reads, Snapshot};
use crate::wire::ItemHash;

/// Salted hash of the client's credential: identifies a tenant without
/// storing the key. Clients without a credential share the tenant of "".
pub fn tenant_of(salt: &[u8; 32], credential: Option<&[u8]>) -> String {
    let h = blake3::keyed_hash(salt, credential.unwrap_or_default());
    h.to_hex()[..24].to_string()
}

/// A tenant's part of the chain index keys. A chain hash is blake3 over
/// the items; the key is that hash XOR a hash of the tenant, so the same
/// history sent under two credentials has two keys, and the index holds
/// no copy of the tenant per prefix nor hashes one per lookup. For a key
/// of one tenant to equal one of another, two chain hashes would have to
/// differ by exactly the XOR of the two tenants' hashes: a 256-bit
/// collision, as hard as one in blake3 itself.
struct TenantScope([u8; 32]);

impl TenantScope {
    fn of(tenant: &str) -> Self {
        Self(*blake3::hash(tenant.as_bytes()).as_bytes())
    }

    fn chain(&self, chain: &ItemHash) -> ItemHash {
        std::array::from_fn(|i| chain[i] ^ self.0[i])
    }
}

/// The result of matching a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Identified {
    /// Conversation id.
    pub conversation: String,
    /// Whether this request opens the conversation.
    pub is_new: bool,
    /// The longest earlier prefix this request repeats, if any.
    pub prefix: Option<PrefixRef>,
    /// The conversation whose recorded prefix, the longest the request
    /// repeats, it extended without going on in it (a branch: the request
    /// went to a new conversation, or to one a shorter prefix continues).
    pub branched_from: Option<String>,
}

/// What [`ConversationIndex::to_look_up`] says to ask a store other
/// processes write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToLookUp {
    /// Where to look the request's longest recorded prefix up from, if
    /// anywhere.
    pub prefix_from: Option<usize>,
    /// The conversation of the longest prefix memory has, if any.
    pub conversation: Option<String>,
    /// That conversation, when the prefix is an answer ending one of its
    /// tips memory has: the request goes on in it unless a request has
    /// left it since (a branch, recorded in the store), so the prefix is
    /// looked up only then (see [`crate::store::LookUp::goes_on`]).
    pub goes_on: Option<String>,
}

#[derive(Debug, Clone)]
struct Hit {
    conversation: String,
    prefix: PrefixRef,
    /// How many items the chain it is indexed by covers: `prefix.len`,
    /// or more for an answer as its client sends it back (see
    /// [`IndexedExchange::chain_echoed`]).
    covers: usize,
    /// Whether that exchange was answered whole (a request repeating one
    /// that was not is its retry).
    answered: bool,
}

#[derive(Default)]
struct Inner {
    /// By chain hash scoped to its tenant ([`TenantScope`]).
    by_chain: foldhash::HashMap<ItemHash, Hit>,
    by_key: Keys,
    by_response: foldhash::HashMap<(String, String), String>,
    /// Per conversation, its indexed prefixes and response ids, oldest
    /// first, so the index stays bounded however long it runs.
    recent: foldhash::HashMap<(String, String), Owned>,
    /// Conversations in the order exchanges were remembered, oldest first,
    /// with the stamp of that exchange (an entry whose stamp is no longer
    /// its conversation's is stale and skipped).
    order: VecDeque<((String, String), u64)>,
    stamp: u64,
    /// Entries all conversations own.
    entries: usize,
    /// How many indexed chains cover each number of items (up to
    /// [`COUNTED_LENGTHS`]): a request's prefix of a length no chain covers
    /// needs no lookup. A stream of one-off requests sharing a long history
    /// (each a conversation of its own) would otherwise probe the index
    /// once per item.
    lengths: Vec<u32>,
}

/// Explicit conversation keys kept in memory, per generation: a session
/// that sends another request within this many other sessions keeps its
/// key here; an older one is looked up in the store.
pub const KEYS: usize = 1 << 17;

/// (tenant, explicit key) → conversation, for the recent sessions.
struct Keys {
    kept: Generations<(String, String), String>,
    /// Start-up loaded only the newest of the stored keys.
    truncated: bool,
}

impl Default for Keys {
    fn default() -> Self {
        Self {
            kept: Generations::new(KEYS),
            truncated: false,
        }
    }
}

impl Keys {
    /// Whether a key not kept may still be in the store.
    fn may_be_stored(&self) -> bool {
        self.truncated || self.kept.dropped_any()
    }
}

/// Looks up a (tenant, explicit key)'s conversation in the store.
pub type LookupKey = Arc<dyn Fn(&str, &str) -> Option<String> + Send + Sync>;

/// What one conversation owns in the index.
#[derive(Default)]
struct Owned {
    entries: VecDeque<Indexed>,
    /// When its latest exchange was remembered.
    stamp: u64,
    /// Its recent tips: exchanges no later exchange of it extended, the
    /// latest last, at most [`MAX_TIPS`].
    tips: VecDeque<i64>,
}

/// Tips kept per conversation: a client that sends a side request or
/// retries from an earlier point keeps a few branches of its history
/// going; past these, the oldest branch no longer continues.
const MAX_TIPS: usize = 4;

/// Prefix lengths past this are looked up without consulting
/// `Inner::lengths`.
const COUNTED_LENGTHS: usize = 1 << 16;

/// Whether a request of `len` items whose prefix is `hit` goes on from it:
/// past it, or from its response, or again after it was not answered whole.
fn extends(hit: &Hit, len: usize) -> bool {
    hit.prefix.full || len > hit.prefix.len || !hit.answered
}

impl Inner {
    /// Whether a request of `len` items whose prefix is `hit` continues
    /// the hit's conversation: it extends one of its recent tips, or
    /// retries one not answered whole.
    fn continues(&self, tenant: &str, hit: &Hit, len: usize) -> bool {
        extends(hit, len) && self.is_tip(tenant, hit)
    }

    /// Whether `hit`'s exchange is one of its conversation's recent tips.
    fn is_tip(&self, tenant: &str, hit: &Hit) -> bool {
        self.recent
            .get(&(tenant.to_string(), hit.conversation.clone()))
            .is_some_and(|o| o.tips.contains(&hit.prefix.exchange))
    }

    /// The prefixes of a request recorded, longest first.
    fn hits<'a>(
        &'a self,
        scope: &'a TenantScope,
        chains: &'a [ItemHash],
    ) -> impl Iterator<Item = &'a Hit> + 'a {
        chains
            .iter()
            .enumerate()
            .rev()
            .filter(|(i, _)| self.may_cover(i + 1))
            .filter_map(|(_, c)| self.by_chain.get(&scope.chain(c)))
    }

    /// Whether some indexed chain covers `len` items.
    fn may_cover(&self, len: usize) -> bool {
        len >= COUNTED_LENGTHS || self.lengths.get(len).is_some_and(|&n| n > 0)
    }

    fn index_chain(&mut self, key: ItemHash, hit: Hit) {
        let len = hit.covers;
        // The same chain again: the same items, so the same length.
        if let Some(old) = self.by_chain.insert(key, hit) {
            self.uncount(old.covers);
        }
        if len < COUNTED_LENGTHS {
            if self.lengths.len() <= len {
                self.lengths.resize(len + 1, 0);
            }
            self.lengths[len] += 1;
        }
    }

    fn uncount(&mut self, len: usize) {
        if let Some(n) = self.lengths.get_mut(len) {
            *n -= 1;
        }
    }

    /// Removes an entry a conversation owned, if it still names that
    /// conversation (another may have indexed the same prefix since).
    fn unindex(&mut self, tenant: &str, conversation: &str, entry: Indexed) {
        match entry {
            Indexed::Chain(k) => {
                if self
                    .by_chain
                    .get(&k)
                    .is_some_and(|h| h.conversation == conversation)
                {
                    if let Some(old) = self.by_chain.remove(&k) {
                        self.uncount(old.covers);
                    }
                }
            }
            Indexed::Response(r) => {
                let k = (tenant.to_string(), r);
                if self.by_response.get(&k).is_some_and(|c| c == conversation) {
                    self.by_response.remove(&k);
                }
            }
        }
    }

    /// Forgets the conversations remembered longest ago while more than
    /// `max` entries are owned.
    fn bound(&mut self, max: usize) {
        while self.entries > max {
            let Some((key, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.recent.get(&key).is_none_or(|o| o.stamp != stamp) {
                continue;
            }
            if let Some(owned) = self.recent.remove(&key) {
                self.entries -= owned.entries.len();
                for entry in owned.entries {
                    self.unindex(&key.0, &key.1, entry);
                }
            }
        }
        // Stale order entries stay few.
        if self.order.len() > 2 * self.recent.len() + 1024 {
            let recent = &self.recent;
            self.order
                .retain(|(key, stamp)| recent.get(key).is_some_and(|o| o.stamp == *stamp));
        }
    }
}

/// One index entry a conversation owns.
enum Indexed {
    /// A chain scoped to its tenant ([`TenantScope`]).
    Chain(ItemHash),
    Response(String),
}

/// Prefixes (and response ids) kept per conversation. A client continues
/// from one of its latest exchanges; one that resumes from an older point
/// simply starts a new conversation.
const MAX_ENTRIES_PER_CONVERSATION: usize = 64;

/// Entries (prefixes and response ids, about 250 bytes each) kept in all:
/// past this, the conversations whose latest exchange is oldest are
/// forgotten, so that a stream of one-off requests (each a conversation of
/// its own) does not grow the index without end. A forgotten
/// conversation's next request starts a new one. Start-up rebuilds the
/// index from at most this many of the newest exchanges (each adds one or
/// two entries), so it reads no more of a large store than it keeps.
pub const MAX_ENTRIES: usize = 200_000;

/// What a start-up loads from the store for the index: as many exchanges as
/// it keeps entries, as many keys as it keeps.
pub const STORE_LIMITS: crate::store::Limits = crate::store::Limits {
    exchanges: MAX_ENTRIES,
    keys: KEYS,
};

/// In-memory index from prefixes, keys and response ids to conversations;
/// rebuilt from the store at start-up.
#[derive(Default)]
pub struct ConversationIndex {
    inner: Mutex<Inner>,
    /// Explicit keys no longer kept in memory are looked up here.
    stored_key: Option<LookupKey>,
    /// A store other processes write too: what the index lacks (another
    /// replica served it) is looked up there, the index being its cache.
    shared: Option<Arc<dyn Reads>>,
}

impl ConversationIndex {
    /// Rebuilds the index from a store snapshot; `stored_key` finds the
    /// keys it does not keep (see [`KEYS`]).
    pub fn from_snapshot(snap: &Snapshot, stored_key: LookupKey) -> Self {
        let idx = Self {
            stored_key: Some(stored_key),
            ..Self::default()
        };
        for ex in &snap.exchanges {
            idx.remember(ex);
        }
        {
            let mut inner = idx.lock();
            for (tenant, key, conv) in &snap.keys {
                inner
                    .by_key
                    .kept
                    .insert((tenant.clone(), key.clone()), conv.clone());
            }
            inner.by_key.truncated = snap.keys_truncated;
        }
        idx
    }

    /// The index over a store other processes write too (see
    /// [`Reads::shared`]): requests it has not seen are looked up there.
    pub fn shared_with(mut self, reads: Arc<dyn Reads>) -> Self {
        if reads.shared() {
            self.shared = Some(reads);
        }
        self
    }

    /// An empty index keeping `per_generation` explicit keys per generation,
    /// the others found by `stored_key`.
    #[cfg(test)]
    fn with_keys(per_generation: usize, stored_key: LookupKey) -> Self {
        let idx = Self {
            stored_key: Some(stored_key),
            ..Self::default()
        };
        idx.lock().by_key.kept = Generations::new(per_generation);
        idx
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where a request's longest recorded prefix is to be looked up in a
    /// store other processes write (see [`Reads::look_up`]): from the
    /// chain after the longest prefix memory has, or nowhere (`None`) when
    /// the store is this process's alone or memory has all but the
    /// request's last item (the next turn of a session this replica served
    /// last: longer would be this very request again). With the
    /// conversation of that longest prefix, if memory has one, and whether
    /// the request goes on in it from one of its tips.
    ///
    /// That is the session this replica served before whose last turns
    /// others served, behind a round-robin balancer: they continued the
    /// same conversation, unless one of them left it (an edit, a back-up),
    /// which its replica recorded before answering. A longer prefix then
    /// names the same conversation, so the store need only say whether
    /// any exchange left it.
    pub fn to_look_up(&self, tenant: &str, chains: &[ItemHash]) -> ToLookUp {
        let scope = TenantScope::of(tenant);
        let inner = self.lock();
        let hit = inner.hits(&scope, chains).next();
        let known = hit.map_or(0, |h| h.covers).min(chains.len());
        let from = (self.shared.is_some() && known + 1 < chains.len()).then_some(known);
        let goes_on = hit.is_some_and(|h| {
            (h.prefix.full || h.covers > h.prefix.len) && inner.continues(tenant, h, chains.len())
        });
        let conversation = hit.map(|h| h.conversation.clone());
        ToLookUp {
            prefix_from: from,
            goes_on: conversation.clone().filter(|_| goes_on && from.is_some()),
            conversation,
        }
    }

    /// Matches a request: `chains[i]` is the chain hash of its first `i + 1`
    /// items. Memory alone, for a request that holds no answer of the
    /// model; see [`ConversationIndex::identify_with`].
    pub fn identify(
        &self,
        tenant: &str,
        explicit_key: Option<&str>,
        previous_response_id: Option<&str>,
        chains: &[ItemHash],
    ) -> Identified {
        self.identify_with(
            tenant,
            explicit_key,
            previous_response_id,
            chains,
            None,
            || false,
        )
    }

    /// [`ConversationIndex::identify`] with what a store other processes
    /// write answered for the request's longest recorded prefix (looked up
    /// where [`ConversationIndex::to_look_up`] says, before the match):
    /// another replica may have recorded a longer one than memory has.
    /// `carries_answer` says whether the request holds an answer of the
    /// model (asked only of a request that sends a tip again whole).
    pub fn identify_with(
        &self,
        tenant: &str,
        explicit_key: Option<&str>,
        previous_response_id: Option<&str>,
        chains: &[ItemHash],
        stored: Option<ChainHit>,
        carries_answer: impl FnOnce() -> bool,
    ) -> Identified {
        let scope = TenantScope::of(tenant);
        let mut inner = self.lock();
        // The longest prefix recorded, and the longest that continues its
        // conversation: the same unless the request repeats an old prefix,
        // as a session does whose first turns went as another's did.
        let (mut hit, mut continued) = {
            let mut hits = inner.hits(&scope, chains);
            let hit = hits.next().cloned();
            let continued = match &hit {
                Some(h) if inner.continues(tenant, h, chains.len()) => Some(h.clone()),
                Some(_) => hits
                    .find(|h| inner.continues(tenant, h, chains.len()))
                    .cloned(),
                None => None,
            };
            (hit, continued)
        };
        let mut hit_is_tip = hit.as_ref().is_some_and(|h| inner.is_tip(tenant, h));
        let known = hit.as_ref().map_or(0, |h| h.prefix.len).min(chains.len());
        if let Some(found) = stored.filter(|f| f.prefix.len > known && f.prefix.len <= chains.len())
        {
            let h = Hit {
                conversation: found.conversation,
                covers: found.prefix.len,
                prefix: found.prefix,
                answered: found.answered,
            };
            // As `Inner::continues`, with the store's tips.
            if found.tip && extends(&h, chains.len()) {
                continued = Some(h.clone());
            }
            hit_is_tip = found.tip;
            hit = Some(h);
        }
        // A recent tip sent again whole, answered, when no tip is extended
        // (a session whose requests go as another's did keeps to its own):
        // a client retrying a turn whose answer it lost, or asking for
        // another answer, goes on in that conversation, whether the tip's
        // exchange was remembered yet or not (before, the request extends
        // the tip before it). Unless it holds no answer of the model: two
        // sessions that open alike share their opening, not the model's
        // answers, so an opening sent again is a session of its own.
        if continued.is_none() {
            continued = hit
                .as_ref()
                .filter(|h| hit_is_tip && !h.prefix.full && h.prefix.len == chains.len())
                .filter(|_| carries_answer())
                .cloned();
        }
        let prefix = hit.as_ref().map(|h| h.prefix);
        if let Some(k) = explicit_key {
            let key = (tenant.to_string(), k.to_string());
            let kept = |inner: &mut Inner| {
                inner.by_key.kept.renew(&key).map(|c| Identified {
                    conversation: c.clone(),
                    is_new: false,
                    prefix,
                    branched_from: None,
                })
            };
            if let Some(found) = kept(&mut inner) {
                return found;
            }
            // Not kept: new, unless the store has it from before. Looked up
            // without the lock (another request of the session may come
            // meanwhile: the first to be identified names it).
            let lookup = self
                .stored_key
                .as_ref()
                .filter(|_| self.shared.is_some() || inner.by_key.may_be_stored());
            let stored = match lookup {
                Some(lookup) => {
                    drop(inner);
                    let stored = lookup(tenant, k);
                    inner = self.lock();
                    if let Some(found) = kept(&mut inner) {
                        return found;
                    }
                    stored
                }
                None => None,
            };
            let is_new = stored.is_none();
            let conversation = stored.unwrap_or_else(crate::ids::new_conversation_id);
            inner.by_key.kept.insert(key, conversation.clone());
            return Identified {
                conversation,
                is_new,
                prefix,
                branched_from: None,
            };
        }
        if let Some(prev) = previous_response_id {
            if let Some(c) = inner
                .by_response
                .get(&(tenant.to_string(), prev.to_string()))
            {
                return Identified {
                    conversation: c.clone(),
                    is_new: false,
                    prefix,
                    branched_from: None,
                };
            }
            drop(inner);
            if let Some(conversation) = self
                .shared
                .as_ref()
                .and_then(|shared| shared.conversation_of_response(tenant, prev))
            {
                return Identified {
                    conversation,
                    is_new: false,
                    prefix,
                    branched_from: None,
                };
            }
        }
        // Gone elsewhere than the longest prefix's conversation, to a new
        // one or to another a shorter prefix continues: a branch of it.
        let longest = hit.map(|h| h.conversation);
        match continued {
            Some(h) => Identified {
                branched_from: longest.filter(|c| *c != h.conversation),
                conversation: h.conversation,
                is_new: false,
                prefix: Some(h.prefix),
            },
            None => Identified {
                conversation: crate::ids::new_conversation_id(),
                is_new: true,
                prefix: None,
                branched_from: longest,
            },
        }
    }

    /// Records a completed exchange's prefixes so later requests find it.
    pub fn remember(&self, ex: &IndexedExchange) {
        let scope = TenantScope::of(&ex.tenant);
        let mut inner = self.lock();
        let mut added = Vec::new();
        let answered = ex.request_len + ex.response_len;
        // An answer as its client sends it back leads to the request's
        // prefix: what the record repeats is what the client sent.
        let echoed = ex.chain_echoed.filter(|_| ex.chain_full.is_some());
        for (chain, len, full, covers) in [
            (ex.chain_request, ex.request_len, false, ex.request_len),
            (ex.chain_full, answered, true, answered),
            (echoed, ex.request_len, false, answered),
        ] {
            if let (Some(c), true) = (chain, len > 0) {
                let prefix = PrefixRef {
                    exchange: ex.id,
                    len,
                    full,
                };
                let hit = Hit {
                    conversation: ex.conversation.clone(),
                    prefix,
                    covers,
                    answered: ex.chain_full.is_some(),
                };
                let key = scope.chain(&c);
                inner.index_chain(key, hit);
                added.push(Indexed::Chain(key));
            }
        }
        if let Some(r) = &ex.response_id {
            inner
                .by_response
                .insert((ex.tenant.clone(), r.clone()), ex.conversation.clone());
            added.push(Indexed::Response(r.clone()));
        }
        let key = (ex.tenant.clone(), ex.conversation.clone());
        inner.stamp += 1;
        let stamp = inner.stamp;
        inner.order.push_back((key.clone(), stamp));
        inner.entries += added.len();
        let owned = inner.recent.entry(key).or_default();
        owned.stamp = stamp;
        owned.entries.extend(added);
        if let Some(extended) = ex.prefix_exchange {
            owned.tips.retain(|&t| t != extended);
        }
        owned.tips.push_back(ex.id);
        if owned.tips.len() > MAX_TIPS {
            owned.tips.pop_front();
        }
        let mut evicted = Vec::new();
        while owned.entries.len() > MAX_ENTRIES_PER_CONVERSATION {
            evicted.extend(owned.entries.pop_front());
        }
        inner.entries -= evicted.len();
        for old in evicted {
            inner.unindex(&ex.tenant, &ex.conversation, old);
        }
        inner.bound(MAX_ENTRIES);
    }

    /// Forgets `tenant`'s conversation `conversation` (it was deleted):
    /// its prefixes and response ids no longer lead to it, and a key that
    /// named it names a new conversation from now on.
    pub fn forget(&self, tenant: &str, conversation: &str) {
        let mut inner = self.lock();
        let key = (tenant.to_string(), conversation.to_string());
        if let Some(owned) = inner.recent.remove(&key) {
            inner.entries -= owned.entries.len();
            for entry in owned.entries {
                inner.unindex(tenant, conversation, entry);
            }
        }
        let keys: Vec<(String, String)> = inner
            .by_key
            .kept
            .keys()
            .filter(|k| {
                k.0 == tenant && inner.by_key.kept.get(*k).is_some_and(|c| c == conversation)
            })
            .cloned()
            .collect();
        for k in keys {
            inner
                .by_key
                .kept
                .insert(k, crate::ids::new_conversation_id());
        }
    }

    /// Number of distinct prefixes indexed (for metrics and tests).
    pub fn len(&self) -> usize {
        self.lock().by_chain.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{chain_hashes, item_hash};
    use serde_json::json;
    use std::sync::atomic::Ordering;

    fn chains(n: usize) -> Vec<ItemHash> {
        let items: Vec<ItemHash> = (0..n).map(|i| item_hash(&json!({"n": i}))).collect();
        chain_hashes(&items)
    }

    /// `Inner::lengths` counts exactly the indexed chains' lengths.
    fn assert_lengths_agree(idx: &ConversationIndex) {
        let inner = idx.lock();
        let mut counted = vec![0u32; inner.lengths.len()];
        for hit in inner.by_chain.values() {
            if hit.covers < COUNTED_LENGTHS {
                counted[hit.covers] += 1;
            }
        }
        assert_eq!(counted, inner.lengths);
    }

    fn ex(id: i64, conv: &str, tenant: &str, c: &[ItemHash], req: usize) -> IndexedExchange {
        IndexedExchange {
            id,
            conversation: conv.into(),
            tenant: tenant.into(),
            request_len: req,
            response_len: 1,
            chain_request: Some(c[req - 1]),
            chain_full: Some(c[req]),
            response_id: Some(format!("resp_{id}")),
            prefix_exchange: None,
            chain_echoed: None,
        }
    }

    /// Identifies a request of `items` and remembers it as exchange `id`,
    /// answered with `answer` (none: it failed); returns its conversation.
    fn turn(
        idx: &ConversationIndex,
        id: i64,
        items: &[ItemHash],
        answer: Option<ItemHash>,
    ) -> String {
        let chains = chain_hashes(items);
        // Past its first item, a request holds an answer of the model.
        let found = idx.identify_with("t", None, None, &chains, None, || items.len() > 1);
        let full = answer.map(|a| chain_hashes(&[items, &[a]].concat())[items.len()]);
        idx.remember(&IndexedExchange {
            id,
            conversation: found.conversation.clone(),
            tenant: "t".into(),
            request_len: items.len(),
            response_len: usize::from(answer.is_some()),
            chain_request: chains.last().copied(),
            chain_full: full,
            chain_echoed: None,
            response_id: None,
            prefix_exchange: found.prefix.map(|p| p.exchange),
        });
        found.conversation
    }

    fn msg(text: &str) -> ItemHash {
        item_hash(&json!({"role": "user", "content": text}))
    }

    #[test]
    fn sessions_that_open_alike_are_conversations_of_their_own() {
        let idx = ConversationIndex::default();
        let (count, five, next) = (msg("Count to five."), msg("1 2 3 4 5"), msg("Now to ten."));
        let mut seen = Vec::new();
        for session in 0..3 {
            let a = turn(&idx, session * 2, &[count], Some(five));
            let b = turn(
                &idx,
                session * 2 + 1,
                &[count, five, next],
                Some(msg("6 … 10")),
            );
            assert_eq!(
                a, b,
                "session {session}: its second request continues its first"
            );
            assert!(
                !seen.contains(&a),
                "session {session} merged into an earlier one"
            );
            seen.push(a);
        }
    }

    #[test]
    fn a_retry_and_a_recent_branch_continue_an_old_prefix_does_not() {
        let idx = ConversationIndex::default();
        let (u1, a1, u2, a2, u3) = (msg("u1"), msg("a1"), msg("u2"), msg("a2"), msg("u3"));
        let conv = turn(&idx, 1, &[u1], Some(a1));
        // The next request fails; its retry is the same conversation.
        assert_eq!(turn(&idx, 2, &[u1, a1, u2], None), conv);
        assert_eq!(turn(&idx, 3, &[u1, a1, u2], Some(a2)), conv);
        // A request answered whole, sent again: its client lost the answer
        // or asks for another. It goes on in its conversation.
        assert_eq!(turn(&idx, 4, &[u1, a1, u2], Some(a2)), conv);
        assert_eq!(turn(&idx, 5, &[u1, a1, u2, a2, u3], Some(msg("a3"))), conv);
        // An old prefix of a conversation, extended otherwise: a new one.
        let old = turn(&idx, 6, &[u1, a1, msg("other")], Some(msg("x")));
        assert_ne!(old, conv);
        // So is an old request sent again: it is no longer a tip.
        assert_ne!(turn(&idx, 7, &[u1, a1, u2], Some(a2)), conv);
    }

    /// A session whose requests go as another's did (the same model,
    /// deterministic, the same task) keeps to its own conversation: a tip
    /// it extends wins over another's tip it repeats.
    #[test]
    fn a_session_that_runs_as_another_did_keeps_to_its_own() {
        let idx = ConversationIndex::default();
        let (task, a1, out, a2) = (msg("task"), msg("a1"), msg("out"), msg("a2"));
        let first = turn(&idx, 1, &[task], Some(a1));
        let second = turn(&idx, 2, &[task], Some(a1));
        assert_ne!(
            first, second,
            "an opening sent again is a session of its own"
        );
        assert_eq!(turn(&idx, 3, &[task, a1, out], Some(a2)), second);
        assert_eq!(turn(&idx, 4, &[task, a1, out], Some(a2)), second);
    }

    #[test]
    fn the_index_forgets_the_conversations_remembered_longest_ago() {
        let idx = ConversationIndex::default();
        // One-off conversations, and one that goes on throughout.
        let long = chains(40);
        let mut convs = Vec::new();
        for i in 0..30usize {
            let c: Vec<ItemHash> = chain_hashes(&[item_hash(&json!({"one-off": i})), [9; 32]]);
            let id = idx.identify("t", None, None, &c[..1]).conversation;
            idx.remember(&ex(i as i64 * 2, &id, "t", &c, 1));
            convs.push((c, id));
            idx.remember(&ex(i as i64 * 2 + 1, "conv_long", "t", &long, i + 1));
            // Three entries per exchange: two prefixes and a response id.
            idx.lock().bound(30);
            let inner = idx.lock();
            assert!(inner.entries <= 30, "{}", inner.entries);
            assert_eq!(
                inner.entries,
                inner
                    .recent
                    .values()
                    .map(|o| o.entries.len())
                    .sum::<usize>()
            );
            assert!(inner.by_chain.len() + inner.by_response.len() <= 30);
            assert!(inner.order.len() <= 2 * inner.recent.len() + 1024);
            drop(inner);
            assert_lengths_agree(&idx);
        }
        // The latest ones are found, the oldest forgotten.
        let (c, id) = &convs[29];
        assert_eq!(&idx.identify("t", None, None, c).conversation, id);
        let (c, id) = &convs[0];
        let again = idx.identify("t", None, None, c);
        assert!(again.is_new && &again.conversation != id);
        assert_eq!(
            idx.identify("t", None, None, &long[..31]).conversation,
            "conv_long"
        );
    }

    #[test]
    fn extending_history_matches_longest_prefix() {
        let idx = ConversationIndex::default();
        let c = chains(6);
        let first = idx.identify("t", None, None, &c[..2]);
        assert!(first.is_new);
        idx.remember(&ex(1, &first.conversation, "t", &c, 2));
        let second = idx.identify("t", None, None, &c[..4]);
        assert_eq!(second.conversation, first.conversation);
        assert_eq!(
            second.prefix,
            Some(PrefixRef {
                exchange: 1,
                len: 3,
                full: true
            })
        );
    }

    #[test]
    fn explicit_keys_not_kept_are_found_in_the_store() {
        let store: Arc<Mutex<std::collections::HashMap<(String, String), String>>> = Arc::default();
        let lookups = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (st, n) = (store.clone(), lookups.clone());
        let idx = ConversationIndex::with_keys(
            2,
            Arc::new(move |t: &str, k: &str| {
                n.fetch_add(1, Ordering::Relaxed);
                st.lock().unwrap().get(&(t.into(), k.into())).cloned()
            }),
        );
        let looked = || lookups.load(Ordering::Relaxed);
        let first = idx.identify("t", Some("k1"), None, &[]);
        assert!(first.is_new);
        assert_eq!(looked(), 0, "nothing dropped yet: a key not kept is new");
        // As the store imports it.
        store
            .lock()
            .unwrap()
            .insert(("t".into(), "k1".into()), first.conversation.clone());
        for k in ["k2", "k3", "k4", "k5"] {
            assert!(idx.identify("t", Some(k), None, &[]).is_new);
        }
        let again = idx.identify("t", Some("k1"), None, &[]);
        assert_eq!(again.conversation, first.conversation, "found in the store");
        assert!(!again.is_new);
        assert_eq!(looked(), 1);
        let kept = idx.identify("t", Some("k1"), None, &[]);
        assert_eq!(kept.conversation, first.conversation);
        assert_eq!(looked(), 1, "kept again");
        let other = idx.identify("u", Some("k1"), None, &[]);
        assert!(other.is_new, "another tenant's key is another conversation");
        assert_ne!(other.conversation, first.conversation);
    }

    /// A store other processes write, as far as the index asks it.
    struct SharedStore;

    /// The views are not what this test asks of it.
    impl crate::store::Queries for SharedStore {
        fn views(&self) -> Result<Box<dyn crate::store::sql::Sql>, crate::store::StoreError> {
            Err(crate::store::StoreError::Closed)
        }
    }

    impl crate::store::Reads for SharedStore {
        fn compaction(&self, _: &str) -> Option<crate::compaction::Compaction> {
            None
        }
        fn conversation_of_key(&self, _: &str, _: &str) -> Option<String> {
            None
        }
        fn response_history(&self, _: &str, _: &str) -> Option<Vec<serde_json::Value>> {
            None
        }
        fn shared(&self) -> bool {
            true
        }
    }

    #[test]
    fn an_answer_sent_back_as_clients_send_it_continues_without_a_read() {
        let idx = ConversationIndex::default().shared_with(Arc::new(SharedStore));
        let answer = json!({"role": "assistant", "content": "1 2 3 4 5", "refusal": null});
        let back = crate::wire::chat::echoed(&answer).expect("refusal: null is dropped");
        assert_eq!(back, json!({"role": "assistant", "content": "1 2 3 4 5"}));
        let (ask, answered, echoed) = (msg("Count to five."), item_hash(&answer), item_hash(&back));
        let first = idx.identify("t", None, None, &chain_hashes(&[ask]));
        let mut e = ex(
            1,
            &first.conversation,
            "t",
            &chain_hashes(&[ask, answered]),
            1,
        );
        e.chain_echoed = Some(chain_hashes(&[ask, echoed])[1]);
        idx.remember(&e);
        assert_lengths_agree(&idx);
        let next = chain_hashes(&[ask, echoed, msg("Now to ten.")]);
        // Memory knows all but the new item: nothing to ask the store.
        assert_eq!(
            idx.to_look_up("t", &next),
            asked(None, Some(&first.conversation))
        );
        // Matched to the request's prefix, not the answer as recorded: the
        // record repeats what the client sent.
        let found = idx.identify("t", None, None, &next);
        assert_eq!(found.conversation, first.conversation);
        let request_only = PrefixRef {
            exchange: 1,
            len: 1,
            full: false,
        };
        assert_eq!(found.prefix, Some(request_only));
        // Without the alias, the same request is asked for.
        let plain = ConversationIndex::default().shared_with(Arc::new(SharedStore));
        let first = plain.identify("t", None, None, &chain_hashes(&[ask]));
        plain.remember(&ex(
            1,
            &first.conversation,
            "t",
            &chain_hashes(&[ask, answered]),
            1,
        ));
        assert_eq!(plain.to_look_up("t", &next).prefix_from, Some(1));
    }

    /// What [`ConversationIndex::to_look_up`] answers for a request that
    /// does not go on from a tip.
    fn asked(prefix_from: Option<usize>, conversation: Option<&String>) -> ToLookUp {
        ToLookUp {
            prefix_from,
            conversation: conversation.cloned(),
            goes_on: None,
        }
    }

    #[test]
    fn a_request_going_on_from_a_tip_says_so_and_a_branch_says_what_it_left() {
        let idx = ConversationIndex::default().shared_with(Arc::new(SharedStore));
        let c = chains(8);
        let first = idx.identify("t", None, None, &c[..2]);
        assert_eq!(first.branched_from, None, "nothing to leave");
        idx.remember(&ex(1, &first.conversation, "t", &c, 2));
        // Turns another replica served after this one's answer, its tip:
        // they went on in its conversation unless one of them left it.
        let on = idx.to_look_up("t", &c[..7]);
        assert_eq!(on.goes_on.as_ref(), Some(&first.conversation));
        assert_eq!(on.prefix_from, Some(3), "asked, should it have branched");
        assert_eq!(idx.to_look_up("u", &c[..7]).goes_on, None, "another tenant");
        // A prefix no answer ends (a request resent, cut short): no tip.
        assert_eq!(idx.to_look_up("t", &c[..2]).goes_on, None);
        // Exchange 2 went on from exchange 1's answer.
        idx.remember(&IndexedExchange {
            prefix_exchange: Some(1),
            ..ex(2, &first.conversation, "t", &c, 4)
        });
        // A request from exchange 1's answer again, edited: exchange 1 is
        // no tip now, so it is a new conversation, one that left the first.
        let items: Vec<ItemHash> = (0..3).map(|i| item_hash(&json!({"n": i}))).collect();
        let edited = chain_hashes(&[&items[..], &[msg("Instead.")]].concat());
        assert_eq!(idx.to_look_up("t", &edited).goes_on, None, "no tip");
        let branch = idx.identify("t", None, None, &edited);
        assert!(branch.is_new);
        assert_eq!(branch.branched_from.as_ref(), Some(&first.conversation));
        // Its next turn, from exchange 2's answer, goes on from a tip.
        let next = idx.identify("t", None, None, &c[..6]);
        assert_eq!((next.is_new, next.branched_from), (false, None));
    }

    #[test]
    fn a_shared_store_is_asked_only_for_prefixes_memory_may_lack() {
        let idx = ConversationIndex::default().shared_with(Arc::new(SharedStore));
        let c = chains(8);
        assert_eq!(
            idx.to_look_up("t", &c[..2]),
            asked(Some(0), None),
            "nothing in memory"
        );
        let first = idx.identify("t", None, None, &c[..2]);
        idx.remember(&ex(1, &first.conversation, "t", &c, 2));
        // Request and answer known here: the next turn adds one item.
        let seen = asked(None, Some(&first.conversation));
        assert_eq!(
            idx.to_look_up("t", &c[..4]),
            seen,
            "all but the new item known"
        );
        let next = idx.identify("t", None, None, &c[..4]);
        assert_eq!(next.conversation, first.conversation);
        // Turns this replica did not see: asked past what it knows.
        assert_eq!(idx.to_look_up("t", &c[..7]).prefix_from, Some(3));
        // The store's answer: a longer prefix another replica recorded,
        // that nothing continued yet.
        let prefix = PrefixRef {
            exchange: 9,
            len: 6,
            full: true,
        };
        let hit = ChainHit {
            conversation: first.conversation.clone(),
            prefix,
            answered: true,
            tip: true,
        };
        let found = idx.identify_with("t", None, None, &c[..7], Some(hit.clone()), || false);
        assert_eq!(found.conversation, first.conversation);
        assert_eq!(found.prefix, Some(prefix));
        // One no longer than memory's changes nothing.
        let short = ChainHit {
            prefix: PrefixRef { len: 2, ..prefix },
            ..hit
        };
        let again = idx.identify_with("t", None, None, &c[..4], Some(short), || false);
        assert_eq!(again.prefix, next.prefix);
        // A store only this process writes is never asked.
        assert_eq!(
            ConversationIndex::default()
                .to_look_up("t", &c[..7])
                .prefix_from,
            None
        );
    }

    #[test]
    fn keys_left_out_at_start_up_are_looked_up() {
        let snap = Snapshot {
            keys_truncated: true,
            ..Snapshot::default()
        };
        let idx = ConversationIndex::from_snapshot(
            &snap,
            Arc::new(|_: &str, k: &str| (k == "stored").then(|| "conv_stored".to_string())),
        );
        let found = idx.identify("t", Some("stored"), None, &[]);
        assert_eq!(found.conversation, "conv_stored");
        assert!(!found.is_new);
        assert!(idx.identify("t", Some("fresh"), None, &[]).is_new);
    }

    #[test]
    fn the_index_stays_bounded_per_conversation() {
        let idx = ConversationIndex::default();
        let c = chains(400);
        for turn in 0..150 {
            let req = 2 * turn + 1;
            idx.remember(&ex(turn as i64, "conv_long", "t", &c, req));
        }
        assert!(idx.len() <= MAX_ENTRIES_PER_CONVERSATION, "{}", idx.len());
        assert_lengths_agree(&idx);
        // The latest exchanges still continue the conversation.
        let next = idx.identify("t", None, None, &c[..302]);
        assert_eq!(next.conversation, "conv_long");
    }

    #[test]
    fn a_prefix_longer_than_the_counted_lengths_is_found() {
        let idx = ConversationIndex::default();
        let items: Vec<ItemHash> = (0..COUNTED_LENGTHS + 3)
            .map(|i| {
                let mut h = [0u8; 32];
                h[..8].copy_from_slice(&(i as u64).to_le_bytes());
                h
            })
            .collect();
        let c = chain_hashes(&items);
        let req = COUNTED_LENGTHS + 1;
        idx.remember(&ex(1, "conv_huge", "t", &c, req));
        // And a short one the same tenant indexed, which must not shadow it.
        idx.remember(&ex(2, "conv_short", "t", &c, 1));
        assert_lengths_agree(&idx);
        let next = idx.identify("t", None, None, &c);
        assert_eq!(next.conversation, "conv_huge");
        assert_eq!(next.prefix.map(|p| p.len), Some(req + 1));
        // Repeating its request, answered whole, does not continue it; the
        // short one it extends, it does.
        let again = idx.identify("t", None, None, &c[..req]);
        assert_eq!(again.conversation, "conv_short");
        assert_eq!(
            again.prefix.map(|p| (p.exchange, p.len)),
            Some((2, 2)),
            "stored as its continuation, within the conversation"
        );
        // A retry of a request not answered whole continues it.
        let mut failed = ex(3, "conv_huge", "t", &c, req + 1);
        failed.chain_full = None;
        failed.prefix_exchange = Some(1);
        idx.remember(&failed);
        let retry = idx.identify("t", None, None, &c[..req + 1]);
        assert_eq!(retry.conversation, "conv_huge");
        assert_eq!(
            retry.prefix.map(|p| (p.exchange, p.len)),
            Some((3, req + 1))
        );
    }

    #[test]
    fn tenants_never_share() {
        let idx = ConversationIndex::default();
        let c = chains(4);
        let a = idx.identify("a", None, None, &c[..2]);
        idx.remember(&ex(1, &a.conversation, "a", &c, 2));
        let b = idx.identify("b", None, None, &c[..4]);
        assert!(b.is_new);
        assert_ne!(a.conversation, b.conversation);
        assert_eq!(b.prefix, None);
        let b2 = idx.identify("b", None, Some("resp_1"), &c[..1]);
        assert!(b2.is_new);
    }

    #[test]
    fn explicit_keys_and_response_ids_group() {
        let idx = ConversationIndex::default();
        let x = idx.identify("t", Some("k"), None, &chains(1));
        let y = idx.identify("t", Some("k"), None, &chains(3)[2..]);
        assert_eq!(x.conversation, y.conversation);
        assert!(x.is_new && !y.is_new);
        let c = chains(3);
        idx.remember(&ex(7, "conv_z", "t", &c, 2));
        let z = idx.identify("t", None, Some("resp_7"), &[]);
        assert_eq!(z.conversation, "conv_z");
    }
}
