//! What a tenant's earlier requests leave for its next one: the bytes
//! before the items, the recent requests' items and hashes, so a repeated
//! history is taken over by a comparison of bytes instead of parsed again.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::Value;

use super::seen::{Reuse, Seen, Shell};
use super::split::{
    finish_split, first_items_at, parse_split, probe_items, skip_whitespace, split_body, SplitBody,
};
use crate::bounded::Generations;
use crate::wire::hash::ItemHash;

/// What the proxy remembers of recent requests to read the next ones
/// faster: per scope (tenant), the bytes before the items of its recent
/// bodies and its recent requests' items and hashes; and, for all, the
/// canonical hash of item bytes seen. Owned by whoever serves the requests
/// (one per `AppState`), each part bounded by [`Generations`], one lock
/// per part and request (never per item).
pub struct ItemCaches {
    pub(super) heads: Mutex<Heads>,
    pub(super) recent: Mutex<Recent>,
    pub(super) hashes: Mutex<Generations<ItemHash, ItemHash>>,
}

impl Default for ItemCaches {
    fn default() -> Self {
        ItemCaches {
            heads: Mutex::new(Heads::default()),
            recent: Mutex::new(Recent::default()),
            // Two generations of half the limit: at most the limit kept.
            hashes: Mutex::new(Generations::new(RAW_CACHE_LIMIT / 2)),
        }
    }
}

impl ItemCaches {
    /// Like [`split_body`], for a body that may repeat the start of a
    /// recent request of the same `scope` (a conversation's next request):
    /// the repeated items are found by comparing bytes and are not parsed
    /// again; the parse covers what precedes the items and what follows the
    /// repeated ones. The result is the same as [`split_body`]'s.
    pub fn split_body_reusing(&self, raw: &[u8], key: &str, scope: &str) -> Option<SplitBody> {
        self.resume_split(raw, key, scope)
            .or_else(|| split_body(raw, key))
    }

    /// Forgets the recent requests, and with them which of their items
    /// the store claimed: after items were deleted, a request repeating
    /// one must not take its items for stored.
    pub fn forget_recent(&self) {
        *self.recent() = Recent::default();
    }

    pub(super) fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn heads(&self) -> std::sync::MutexGuard<'_, Heads> {
        self.heads.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn hashes(&self) -> std::sync::MutexGuard<'_, Generations<ItemHash, ItemHash>> {
        self.hashes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The canonical hash of a value whose bytes hash to `key`: from the
    /// cache, or `compute`d (from the parsed value) and cached.
    pub fn cached_hash(&self, key: ItemHash, compute: impl FnOnce() -> ItemHash) -> ItemHash {
        if let Some(h) = self.hashes().renew(&key) {
            return *h;
        }
        let h = compute();
        self.hashes().insert(key, h);
        h
    }

    pub(super) fn resume_split(&self, raw: &[u8], key: &str, scope: &str) -> Option<SplitBody> {
        let first = self.probe_items_known(raw, key, scope)?;
        let recent_key = recent_key(scope, first.iter().map(|s| &raw[s.clone()]));
        let candidates = self.recent().get(&recent_key);
        resume_from(raw, key, recent_key, candidates)
    }

    /// [`probe_items`], and without reading the bytes before the items when
    /// a recent body of the scope began with the same bytes up to its first
    /// item (long tool definitions or instructions before the items): the
    /// parse is where it was in that body, so the first item starts at the
    /// same place.
    pub(super) fn probe_items_known(
        &self,
        raw: &[u8],
        key: &str,
        scope: &str,
    ) -> Option<Vec<Range<usize>>> {
        let heads = self.heads().of(scope, key);
        let known = heads
            .iter()
            .find(|h| raw.len() > h.len() && raw.starts_with(h));
        if let Some(spans) = known.and_then(|h| first_items_at(raw, h.len())) {
            return Some(spans);
        }
        let spans = probe_items(raw, key)?;
        if spans[0].start >= MIN_HEAD && known.is_none() {
            self.heads().remember(scope, key, &raw[..spans[0].start]);
        }
        Some(spans)
    }
}

/// The split of a body that may repeat one of `candidates` (recent
/// requests under `recent_key`).
pub(super) fn resume_from(
    raw: &[u8],
    key: &str,
    recent_key: ItemHash,
    candidates: Vec<Arc<Seen>>,
) -> Option<SplitBody> {
    let (items, seen) = best_candidate(candidates, |seen| seen.leading_items(raw))?;
    if items == 0 {
        return None;
    }
    if let Some(mut body) = same_shell(raw, &seen, items) {
        body.reuse = Some(Reuse {
            key: recent_key,
            seen,
            items,
        });
        return Some(body);
    }
    // Everything up to the end of item `items - 1` is the recent body's
    // bytes, which parsed. Parse the rest as if those items were not there:
    // the bytes before the first item, then from the next item (or the
    // array's end) on.
    let start = seen.spans[0].start;
    let mut resume = skip_whitespace(raw, seen.spans[items - 1].end);
    match raw.get(resume)? {
        b']' => {}
        b',' => {
            resume = skip_whitespace(raw, resume + 1);
            if raw.get(resume) != Some(&b'{') {
                return None;
            }
        }
        _ => return None,
    }
    let mut joined = Vec::with_capacity(start + raw.len() - resume);
    joined.extend_from_slice(&raw[..start]);
    joined.extend_from_slice(&raw[resume..]);
    let split = parse_split(&joined, key)?;
    if split.item_arrays != 1 {
        // A repeated item key: the full parse sorts that out.
        return None;
    }
    let base = joined.as_ptr() as usize;
    let span_of = |text: &str| {
        let at = text.as_ptr() as usize - base;
        let at = if at < start { at } else { at - start + resume };
        at..at + text.len()
    };
    let mut spans = seen.spans[..items].to_vec();
    spans.extend(split.items?.iter().map(|i| span_of(i.get())));
    let tools = split.tools.map(|t| span_of(t.get()));
    let mut body = finish_split(raw, split.obj, Some(spans), tools)?;
    body.reuse = Some(Reuse {
        key: recent_key,
        seen,
        items,
    });
    Some(body)
}

/// The split of a body whose first `items` items are `seen`'s, when its
/// bytes after its last item are `seen`'s bytes after its own last item:
/// then all its bytes outside the items are `seen`'s (those before the
/// items are part of the repeated start), and only the items that follow
/// the repeated ones are read, to find where they are.
pub(super) fn same_shell(raw: &[u8], seen: &Seen, items: usize) -> Option<SplitBody> {
    let shell = seen.shell.as_ref()?;
    let seen_end = seen.spans.last()?.end;
    let mut spans = seen.spans[..items].to_vec();
    let mut at = spans.last()?.end;
    loop {
        at = skip_whitespace(raw, at);
        match raw.get(at)? {
            b']' => break,
            b',' => at = skip_whitespace(raw, at + 1),
            _ => return None,
        }
        if raw.get(at) != Some(&b'{') {
            return None;
        }
        let mut one = serde_json::Deserializer::from_slice(&raw[at..]).into_iter::<&RawValue>();
        one.next()?.ok()?;
        let end = at + one.byte_offset();
        spans.push(at..end);
        at = end;
    }
    let end = spans.last()?.end;
    if raw[end..] != seen.raw[seen_end..] {
        return None;
    }
    // Ranges after the items move with the items' end.
    let moved = |r: &Range<usize>| {
        if r.start >= seen_end {
            r.start - seen_end + end..r.end - seen_end + end
        } else {
            r.clone()
        }
    };
    let tools = shell.tools.as_ref().map(|(r, key)| (moved(r), *key));
    // The shell handed on names ranges of this body, as the next request
    // will move them from this body's items' end.
    let shell = if tools == shell.tools {
        shell.clone()
    } else {
        Arc::new(Shell {
            obj: shell.obj.clone(),
            tools: tools.clone(),
            body_key: shell.body_key,
        })
    };
    Some(SplitBody {
        body: Value::Object(shell.obj.clone()),
        spans: Some(spans),
        body_key: shell.body_key,
        tools,
        reuse: None,
        shell: Some(shell),
    })
}

/// Bytes before the items shorter than this are read each time (that is
/// as fast as comparing them).
pub(super) const MIN_HEAD: usize = 1024;
/// Distinct starts kept per scope and item key.
pub(super) const HEADS_PER_SCOPE: usize = 4;
/// Bytes of starts kept in all (two generations of half).
pub(super) const HEAD_BYTES: usize = 16 << 20;

/// Per scope and item key, the bytes up to the first item of its recent
/// bodies, newest first; weighed by their bytes.
pub(super) struct Heads {
    pub(super) by_scope: Generations<String, Vec<(String, VecDeque<Bytes>)>>,
}

impl Default for Heads {
    fn default() -> Self {
        // A start is at least `MIN_HEAD` bytes, so the weight bounds the
        // number of scopes too.
        Heads {
            by_scope: Generations::weighed(HEAD_BYTES / MIN_HEAD, HEAD_BYTES / 2),
        }
    }
}

impl Heads {
    pub(super) fn of(&mut self, scope: &str, key: &str) -> Vec<Bytes> {
        let keys = self
            .by_scope
            .renew(scope)
            .map(Vec::as_slice)
            .unwrap_or_default();
        keys.iter()
            .find(|(k, _)| k == key)
            .map(|(_, q)| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub(super) fn remember(&mut self, scope: &str, key: &str, head: &[u8]) {
        if head.len() > HEAD_BYTES / 16 {
            return;
        }
        let mut keys = self.by_scope.remove(scope).unwrap_or_default();
        let at = match keys.iter().position(|(k, _)| k == key) {
            Some(at) => at,
            None => {
                keys.push((key.to_string(), VecDeque::new()));
                keys.len() - 1
            }
        };
        let q = &mut keys[at].1;
        q.push_front(Bytes::copy_from_slice(head));
        q.truncate(HEADS_PER_SCOPE);
        let bytes = keys
            .iter()
            .flat_map(|(_, q)| q.iter().map(Bytes::len))
            .sum();
        self.by_scope.insert_weighed(scope.to_string(), keys, bytes);
    }
}

/// Bytes of each of the first two items that pick a request's candidates.
pub(super) const RECENT_KEY_BYTES: usize = 1024;

/// The key of a request among the recent ones: its scope and its first two
/// items. Requests are told apart by their first two items (the system
/// prompt alone is shared by every session of an agent). The key only
/// picks candidates (their bytes are compared), so the first kilobyte of
/// each item is enough.
pub(super) fn recent_key<'a>(scope: &str, items: impl Iterator<Item = &'a [u8]>) -> ItemHash {
    let mut key = blake3::Hasher::new();
    key.update(&(scope.len() as u64).to_le_bytes());
    key.update(scope.as_bytes());
    for bytes in items.take(2) {
        key.update(&(bytes.len() as u64).to_le_bytes());
        key.update(&bytes[..bytes.len().min(RECENT_KEY_BYTES)]);
    }
    *key.finalize().as_bytes()
}

/// The recent request (oldest first in `candidates`) that shares the most
/// leading items with a body, by `matching`. The newest are compared first,
/// and one that shares all its items but its last ends the search: a
/// conversation's next request, or the same history with another last
/// message. Each comparison reads up to the whole body.
pub(super) fn best_candidate(
    candidates: Vec<Arc<Seen>>,
    matching: impl Fn(&Seen) -> usize,
) -> Option<(usize, Arc<Seen>)> {
    let mut best: Option<(usize, Arc<Seen>)> = None;
    for seen in candidates.into_iter().rev() {
        let n = matching(&seen);
        let enough = n > 0 && n + 1 >= seen.spans.len();
        if best.as_ref().is_none_or(|(b, _)| n > *b) {
            best = Some((n, seen));
        }
        if enough {
            break;
        }
    }
    best
}

/// Bytes of recent requests kept for [`ItemList::hashes_and_chains`]
/// (two generations of half).
pub(super) const RECENT_BYTES: usize = 64 << 20;
/// Recent requests kept per first-two-items key (concurrent branches of a
/// conversation, retries).
pub(super) const RECENT_PER_KEY: usize = 4;
/// Most first-two-items keys of one generation (a key's requests are
/// weighed by their bytes, and small ones weigh little).
pub(super) const RECENT_KEYS: usize = 1 << 16;

/// Recent requests by key, weighed by their bytes: at most
/// [`RECENT_BYTES`] in all, unless one request alone weighs more than half.
pub(super) struct Recent {
    pub(super) by_key: Generations<ItemHash, VecDeque<Arc<Seen>>>,
    pub(super) next_id: u64,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            by_key: Generations::weighed(RECENT_KEYS, RECENT_BYTES / 2),
            next_id: 0,
        }
    }
}

impl Recent {
    pub(super) fn get(&self, key: &ItemHash) -> Vec<Arc<Seen>> {
        self.by_key
            .get(key)
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub(super) fn insert(&mut self, key: ItemHash, mut seen: Seen, superseded: Option<u64>) {
        self.next_id += 1;
        seen.id = self.next_id;
        let mut q = self.by_key.remove(&key).unwrap_or_default();
        if let Some(i) = superseded.and_then(|id| q.iter().position(|s| s.id == id)) {
            q.remove(i);
        }
        q.push_back(Arc::new(seen));
        if q.len() > RECENT_PER_KEY {
            q.pop_front();
        }
        // A key's requests weigh no more than a generation may (but the
        // newest stays), so that two generations hold at most
        // `RECENT_BYTES`.
        let mut bytes: usize = q.iter().map(|s| s.raw.len()).sum();
        while bytes > RECENT_BYTES / 2 && q.len() > 1 {
            if let Some(old) = q.pop_front() {
                bytes -= old.raw.len();
            }
        }
        self.by_key.insert_weighed(key, q, bytes);
    }
}

/// Most entries kept in the bytes → canonical hash cache (about 100 bytes
/// each), the least recently used going first. The hash is a pure function
/// of the bytes, so one cache serves every tenant without telling one
/// anything about another.
pub(super) const RAW_CACHE_LIMIT: usize = 200_000;
