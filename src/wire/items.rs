//! A request's items as the client sent them.
//!
//! Most of a long conversation's request is history the proxy has seen
//! before. Building a `Value` tree of all of it on every request, and
//! hashing its canonical form, was most of the proxy's cost per request;
//! instead the body is parsed once with its item array left as byte ranges
//! ([`split_body`]), each item's canonical hash is found through a hash of
//! its bytes ([`ItemList::hashes`]), and an item is parsed only when
//! something must look inside it: a compaction, a new item's token count, a
//! body that has to be rewritten.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde_json::Value;

use super::hash::{item_hash, ItemHash};

mod members;
mod reuse;
mod seen;
mod split;
mod tools;

pub use reuse::ItemCaches;
pub(crate) use seen::common_prefix;
pub use seen::{Reuse, Shell};
pub use split::{split_body, SplitBody};
pub use tools::Tools;

use reuse::{best_candidate, recent_key};
use seen::{parse, Seen};

/// The items of one request: parsed values, or ranges of the client's body
/// (after `head`, items the proxy made up, such as the Responses
/// `instructions` pseudo-item), parsed on first need.
pub struct ItemList {
    head: Head,
    raw: Bytes,
    spans: Vec<Range<usize>>,
    values: OnceLock<Arc<Vec<Value>>>,
    reuse: Option<Reuse>,
    shell: Option<Arc<Shell>>,
    /// The caches its hashes go through, if any (else they are computed).
    caches: Option<Arc<ItemCaches>>,
}

/// The parsed items before the client's bytes: the proxy's own (such as
/// the Responses `instructions` pseudo-item), or a compaction's
/// replacement, shared by every request it applies to rather than copied.
enum Head {
    Own(Vec<Value>),
    Shared(Arc<dyn AsRef<[Value]> + Send + Sync>),
}

impl std::ops::Deref for Head {
    type Target = [Value];

    fn deref(&self) -> &[Value] {
        match self {
            Head::Own(values) => values,
            Head::Shared(values) => (**values).as_ref(),
        }
    }
}

impl From<Vec<Value>> for ItemList {
    fn from(values: Vec<Value>) -> Self {
        ItemList {
            head: Head::Own(Vec::new()),
            raw: Bytes::new(),
            spans: Vec::new(),
            values: OnceLock::from(Arc::new(values)),
            reuse: None,
            shell: None,
            caches: None,
        }
    }
}

impl ItemList {
    /// `head` followed by the items at `spans` of `raw` (each a JSON object,
    /// as [`split_body`] found them).
    pub fn raw(head: Vec<Value>, raw: Bytes, spans: Vec<Range<usize>>) -> Self {
        ItemList {
            head: Head::Own(head),
            raw,
            spans,
            values: OnceLock::new(),
            reuse: None,
            shell: None,
            caches: None,
        }
    }

    /// The caches [`ItemList::hashes`] and [`ItemList::hashes_and_chains`]
    /// go through (the proxy's own): without them, every hash is computed
    /// and nothing is remembered for the next request.
    pub fn with_caches(mut self, caches: Arc<ItemCaches>) -> Self {
        self.caches = Some(caches);
        self
    }

    /// What [`ItemCaches::split_body_reusing`] found this list's body repeats, for
    /// [`ItemList::hashes_and_chains`].
    pub fn with_reuse(mut self, reuse: Option<Reuse>) -> Self {
        self.reuse = reuse;
        self
    }

    /// What the split of this list's body found outside the items, kept
    /// with the list's bytes by [`ItemList::hashes_and_chains`].
    pub fn with_shell(mut self, shell: Option<Arc<Shell>>) -> Self {
        self.shell = shell;
        self
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        match self.values.get() {
            Some(v) => v.len(),
            None => self.head.len() + self.spans.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the items are (still) the client's bytes.
    fn is_raw(&self) -> bool {
        self.values.get().is_none()
    }

    /// All items parsed (once; later calls share the result).
    pub fn values(&self) -> Arc<Vec<Value>> {
        self.values
            .get_or_init(|| {
                let mut all = self.head.to_vec();
                all.extend(self.spans.iter().map(|s| parse(&self.raw[s.clone()])));
                Arc::new(all)
            })
            .clone()
    }

    /// The list with its first `covered` items replaced by `replacement`
    /// (a compaction applied), the items after them kept as they are: still
    /// the client's bytes when they were, so the history the compaction
    /// replaces (most of a long request) is not parsed for every request
    /// it is applied to. Its items are `replacement` followed by
    /// [`ItemList::values`] past `covered`.
    pub fn with_prefix_replaced(&self, covered: usize, replacement: &[Value]) -> ItemList {
        let mut head = replacement.to_vec();
        if let Some(values) = self.values.get() {
            head.extend_from_slice(&values[covered.min(values.len())..]);
            return head.into();
        }
        let from_head = covered.min(self.head.len());
        head.extend_from_slice(&self.head[from_head..]);
        let from_span = covered
            .saturating_sub(self.head.len())
            .min(self.spans.len());
        ItemList::raw(head, self.raw.clone(), self.spans[from_span..].to_vec())
    }

    /// [`ItemList::with_prefix_replaced`] with a replacement the list
    /// shares (a stored compaction's, applied to every request it covers)
    /// rather than copies: while the list is the client's bytes and
    /// `covered` takes in the proxy's own items before them.
    pub fn with_prefix_shared(
        &self,
        covered: usize,
        replacement: Arc<dyn AsRef<[Value]> + Send + Sync>,
    ) -> ItemList {
        if !self.is_raw() || covered < self.head.len() {
            return self.with_prefix_replaced(covered, (*replacement).as_ref());
        }
        let from_span = (covered - self.head.len()).min(self.spans.len());
        let mut list = ItemList::raw(
            Vec::new(),
            self.raw.clone(),
            self.spans[from_span..].to_vec(),
        );
        list.head = Head::Shared(replacement);
        list
    }

    /// Where the client's bytes of this list's first `covered` items lie,
    /// for a body that sends other items in their place: the range of
    /// [`ItemList::body_bytes`] to cut (from the first item's start to
    /// the first kept item's start, or to the last item's end when none is
    /// kept) and whether items follow it (what goes in its place then
    /// needs a comma after it). `None` when the list holds no client bytes
    /// or `covered` ends inside the items the proxy made up (`head`).
    pub fn covered_span(&self, covered: usize) -> Option<(Range<usize>, bool)> {
        let own = covered.checked_sub(self.head.len())?;
        let first = self.spans.first()?;
        match self.spans.get(own) {
            Some(kept) => Some((first.start..kept.start, true)),
            None if own == self.spans.len() => Some((first.start..self.spans[own - 1].end, false)),
            None => None,
        }
    }

    /// The client's body that the items' byte ranges are of (empty for a
    /// list of values).
    pub fn body_bytes(&self) -> &Bytes {
        &self.raw
    }

    /// The items, taken out (parsed if need be).
    pub fn into_values(self) -> Vec<Value> {
        let values = self.values();
        drop(self);
        Arc::try_unwrap(values).unwrap_or_else(|shared| (*shared).clone())
    }

    /// Item `i`, parsed for the occasion when the list is still raw.
    pub fn item(&self, i: usize) -> Cow<'_, Value> {
        if let Some(v) = self.values.get() {
            return Cow::Borrowed(&v[i]);
        }
        match i.checked_sub(self.head.len()) {
            None => Cow::Borrowed(&self.head[i]),
            Some(j) => Cow::Owned(parse(&self.raw[self.spans[j].clone()])),
        }
    }

    /// Item `i`'s `role` and `type` members (empty when absent or not
    /// text), read from the client's bytes without building the item while
    /// the list is raw: what kind of item it is, for a look along a
    /// history whose items are mostly long text.
    pub fn role_and_type(&self, i: usize) -> (Cow<'_, str>, Cow<'_, str>) {
        if let Some(found) = self.raw_json(i).and_then(members::role_and_type) {
            return found;
        }
        let member =
            |item: &Value, m: &str| item.get(m).and_then(Value::as_str).map(str::to_string);
        let item = self.item(i);
        let (role, kind) = (member(&item, "role"), member(&item, "type"));
        (
            role.unwrap_or_default().into(),
            kind.unwrap_or_default().into(),
        )
    }

    /// Item `i` as the client's own JSON bytes, when the list is raw and
    /// the item is one of its array's.
    pub fn raw_json(&self, i: usize) -> Option<&[u8]> {
        if self.values.get().is_some() || !self.is_raw() {
            return None;
        }
        let j = i.checked_sub(self.head.len())?;
        Some(&self.raw[self.spans.get(j)?.clone()])
    }

    /// The client's bytes of item `i`, when it is one of its array's,
    /// parsed or not (the values are parsed from these very bytes).
    fn client_bytes(&self, i: usize) -> Option<&[u8]> {
        let j = i.checked_sub(self.head.len())?;
        Some(&self.raw[self.spans.get(j)?.clone()])
    }

    /// Item `i` serialised: the client's own bytes when it is one of its
    /// array's. Also once the list is parsed: an item without a canonical
    /// form parses to `null`, and the record keeps it as it was given.
    pub fn json(&self, i: usize) -> String {
        match self.client_bytes(i) {
            Some(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            None => serde_json::to_string(&*self.item(i)).unwrap_or_default(),
        }
    }

    /// Length of item `i`'s JSON: the client's bytes when the list is raw.
    pub fn byte_len(&self, i: usize) -> usize {
        if self.is_raw() {
            if let Some(j) = i.checked_sub(self.head.len()) {
                return self.spans[j].len();
            }
        }
        serde_json::to_vec(&*self.item(i)).map_or(0, |b| b.len())
    }

    /// Whether any item's bytes contain `needle` (a conservative test for a
    /// kind of item, before parsing anything). Parsed lists answer true.
    pub fn may_contain(&self, needle: &str) -> bool {
        if !self.is_raw() {
            return true;
        }
        let finder = memchr::memmem::Finder::new(needle.as_bytes());
        // The items' bytes in one search: a match across two items (it
        // would take their separator) only costs a parse.
        let items = match (self.spans.first(), self.spans.last()) {
            (Some(first), Some(last)) => &self.raw[first.start..last.end],
            _ => &[][..],
        };
        finder.find(items).is_some()
            || self
                .head
                .iter()
                .any(|v| serde_json::to_vec(v).is_ok_and(|b| finder.find(&b).is_some()))
    }

    /// The canonical hash of every item ([`item_hash`]). Raw items are
    /// looked up by a hash of their bytes first; only items whose bytes were
    /// never seen are parsed.
    pub fn hashes(&self) -> Vec<ItemHash> {
        // Through the bytes while there are any, parsed or not: an item
        // without a canonical form hashes as its bytes, not as `null`.
        if self.spans.is_empty() && !self.is_raw() {
            return self.values().iter().map(item_hash).collect();
        }
        let mut out: Vec<ItemHash> = self.head.iter().map(item_hash).collect();
        out.extend(self.raw_hashes(0));
        out
    }

    /// Like [`ItemList::hashes`], and faster for a conversation's next
    /// request: the history it repeats is found byte for byte in the
    /// `scope`'s (the tenant's) recent requests, whose hashes are reused;
    /// only the rest is hashed. Remembers this request for the next one.
    /// With them, the chain hashes over them ([`super::chain_hashes`]),
    /// those of the repeated history reused too.
    /// And which of the hashes the store has claimed already
    /// ([`Claims`]).
    pub fn hashes_and_chains(&self, scope: &str) -> (Vec<ItemHash>, Vec<ItemHash>, Claims) {
        let Some(caches) = self.caches.as_deref().filter(|_| self.is_raw()) else {
            let hashes = self.hashes();
            let chains = super::hash::chain_hashes(&hashes);
            return (hashes, chains, Claims::default());
        };
        if self.spans.is_empty() {
            let hashes = self.hashes();
            let chains = super::hash::chain_hashes(&hashes);
            return (hashes, chains, Claims::default());
        }
        let head: Vec<ItemHash> = self.head.iter().map(item_hash).collect();
        let mut chains = super::hash::chain_hashes(&head);
        let head_chain = chains.last().copied().unwrap_or([0; 32]);
        let (key, best) = match &self.reuse {
            // The split found it already.
            Some(r) => (r.key, Some((r.items, r.seen.clone()))),
            None => {
                let key = recent_key(scope, self.spans.iter().map(|s| &self.raw[s.clone()]));
                let candidates = caches.recent().get(&key);
                let best = best_candidate(candidates, |seen| seen.matching(&self.raw, &self.spans));
                (key, best)
            }
        };
        let best = best.as_ref().map(|(n, seen)| (*n, seen));
        let reused = best.map(|(n, _)| n).unwrap_or(0);
        // Sized for all items at once: the repeated ones are most of them.
        let mut items: Vec<ItemHash> = Vec::with_capacity(self.spans.len());
        if let Some((n, seen)) = best {
            items.extend_from_slice(&seen.hashes[..n]);
        }
        items.extend(self.raw_hashes(reused));
        // The chains of the repeated items, when they follow the same head.
        let mut item_chains: Vec<ItemHash> = Vec::with_capacity(items.len());
        if let Some((n, seen)) = best.filter(|(_, seen)| seen.head_chain == head_chain) {
            item_chains.extend_from_slice(&seen.chains[..n]);
        }
        let mut prev = item_chains.last().copied().unwrap_or(head_chain);
        for h in &items[item_chains.len()..] {
            prev = super::hash::chain_extend(prev, std::slice::from_ref(h));
            item_chains.push(prev);
        }
        // A request that repeats all of a recent one takes its place: the
        // next request of the conversation will extend this one.
        let superseded = best
            .filter(|(n, seen)| *n == seen.spans.len())
            .map(|(_, seen)| seen.id);
        let own = Arc::new(AtomicBool::new(false));
        let claims = Claims {
            earlier: best
                .map(|(n, seen)| (seen.claimed.clone(), self.head.len()..self.head.len() + n)),
            own: Some(own.clone()),
        };
        let mut out = Vec::with_capacity(head.len() + items.len());
        out.extend_from_slice(&head);
        out.extend_from_slice(&items);
        chains.extend_from_slice(&item_chains);
        let seen = Seen {
            id: 0,
            raw: self.raw.clone(),
            spans: self.spans.clone(),
            hashes: items,
            head_chain,
            chains: item_chains,
            shell: self.shell.clone(),
            claimed: own,
        };
        caches.recent().insert(key, seen, superseded);
        (out, chains, claims)
    }

    /// Hashes of the raw items from `from` on, through the bytes cache.
    fn raw_hashes(&self, from: usize) -> Vec<ItemHash> {
        let spans = &self.spans[from.min(self.spans.len())..];
        let Some(caches) = self.caches.as_deref() else {
            return spans
                .iter()
                .map(|s| super::hash::text_item_hash(&self.raw[s.clone()]))
                .collect();
        };
        let keys: Vec<ItemHash> = spans
            .iter()
            .map(|s| *blake3::hash(&self.raw[s.clone()]).as_bytes())
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        {
            let mut cache = caches.hashes();
            for (j, key) in keys.iter().enumerate() {
                match cache.renew(key) {
                    Some(h) => out.push(*h),
                    None => {
                        missing.push(j);
                        out.push([0; 32]);
                    }
                }
            }
        }
        if missing.is_empty() {
            return out;
        }
        let found: Vec<(ItemHash, ItemHash)> = missing
            .iter()
            .map(|&j| {
                let h = super::hash::text_item_hash(&self.raw[spans[j].clone()]);
                out[j] = h;
                (keys[j], h)
            })
            .collect();
        let mut cache = caches.hashes();
        for (k, h) in found {
            cache.insert(k, h);
        }
        out
    }
}

/// Which of a request's item hashes the store has claimed already (see
/// `Store::claim_items`): those it repeats of a recent request whose
/// exchange was recorded. Lets the record skip looking them up again.
#[derive(Debug, Default)]
pub struct Claims {
    /// The recent request's flag, and where its items are in this one's.
    earlier: Option<(Arc<AtomicBool>, Range<usize>)>,
    /// This request's own flag, for the requests that repeat it.
    own: Option<Arc<AtomicBool>>,
}

impl Claims {
    /// Positions of hashes known to be claimed (empty when none are).
    pub fn known(&self) -> Range<usize> {
        match &self.earlier {
            Some((flag, range)) if flag.load(Ordering::Acquire) => range.clone(),
            _ => 0..0,
        }
    }

    /// All of this request's hashes are claimed now.
    pub fn all_claimed(&self) {
        if let Some(own) = &self.own {
            own.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reuse::{Recent, RECENT_BYTES, RECENT_PER_KEY};
    use super::split::probe_items;
    use super::*;
    use serde_json::json;

    /// The caches of the tests (each test uses scopes of its own).
    fn caches() -> &'static Arc<ItemCaches> {
        static C: OnceLock<Arc<ItemCaches>> = OnceLock::new();
        C.get_or_init(Arc::default)
    }

    fn raw_list(head: Vec<Value>, raw: Bytes, spans: Vec<Range<usize>>) -> ItemList {
        ItemList::raw(head, raw, spans).with_caches(caches().clone())
    }

    fn split_body_reusing(raw: &[u8], key: &str, scope: &str) -> Option<SplitBody> {
        caches().split_body_reusing(raw, key, scope)
    }

    fn probe_items_known(raw: &[u8], key: &str, scope: &str) -> Option<Vec<Range<usize>>> {
        caches().probe_items_known(raw, key, scope)
    }

    fn cached_hash(key: ItemHash, compute: impl FnOnce() -> ItemHash) -> ItemHash {
        caches().cached_hash(key, compute)
    }

    fn list(raw: &str, key: &str) -> (Value, ItemList) {
        let bytes = Bytes::from(raw.to_string());
        let split = split_body(&bytes, key).expect("splits");
        let spans = split.spans.expect("an item array");
        (split.body, raw_list(Vec::new(), bytes, spans))
    }

    #[test]
    fn items_stay_bytes_until_needed() {
        let raw = r#"{"model":"m", "messages": [ {"role":"user","content":"a\"b"} ,{"content":"x","role":"assistant"}],"stream":true}"#;
        let (body, items) = list(raw, "messages");
        // The body keeps its keys in order, with an empty array in place.
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"model":"m","messages":[],"stream":true}"#
        );
        assert_eq!(items.len(), 2);
        assert!(items.is_raw());
        assert_eq!(items.json(1), r#"{"content":"x","role":"assistant"}"#);
        assert_eq!(*items.item(0), json!({"role": "user", "content": "a\"b"}));
        assert!(items.is_raw(), "looking at one item parses only that one");
        assert_eq!(
            *items.values(),
            vec![
                json!({"role": "user", "content": "a\"b"}),
                json!({"role": "assistant", "content": "x"})
            ]
        );
    }

    #[test]
    fn a_replaced_prefix_keeps_the_items_after_it_unparsed() {
        let raw = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}]}"#;
        let replacement = vec![json!({"role": "system", "content": "summary"})];
        // What applying a compaction gave when the whole list was parsed.
        let rewrite = |all: &[Value], covered: usize| {
            let mut out = replacement.clone();
            out.extend_from_slice(&all[covered.min(all.len())..]);
            out
        };
        for covered in 0..=5 {
            let (_, items) = list(raw, "messages");
            let view = items.with_prefix_replaced(covered, &replacement);
            assert!(
                items.is_raw(),
                "covered {covered}: the client's list stays unparsed"
            );
            assert_eq!(
                view.spans.len(),
                4 - covered.min(4),
                "covered {covered}: the kept items are still bytes"
            );
            assert_eq!(
                *view.values(),
                rewrite(&items.values(), covered),
                "covered {covered}"
            );
            // From the list once parsed: the same items.
            let parsed = items.with_prefix_replaced(covered, &replacement);
            assert_eq!(*parsed.values(), *view.values());
            // A list with parsed items ahead of its bytes.
            let developer = json!({"role": "developer", "content": "d"});
            let mixed = ItemList::raw(
                vec![developer.clone()],
                items.raw.clone(),
                items.spans.clone(),
            );
            let mut all = vec![developer];
            all.extend(items.values().iter().cloned());
            assert_eq!(
                *mixed.with_prefix_replaced(covered, &replacement).values(),
                rewrite(&all, covered),
                "covered {covered} of a list with a parsed head"
            );
        }
    }

    #[test]
    fn hashes_equal_the_canonical_hashes() {
        let raw =
            r#"{"messages":[{"role":"user","content":"hi"},{"b":1,"a":[1,2,{"y":null,"x":"é"}]}]}"#;
        let want: Vec<ItemHash> = serde_json::from_str::<Value>(raw).unwrap()["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(item_hash)
            .collect();
        let (_, items) = list(raw, "messages");
        assert_eq!(items.hashes(), want, "first time: parsed");
        assert_eq!(items.hashes(), want, "second time: from the cache");
        // Other bytes for the same content: another cache entry, same hash.
        let (_, spaced) = list(
            r#"{"messages":[ { "content" : "hi", "role":"user" } ,{"a":[1,2,{"x":"\u00e9","y":null}],"b":1}]}"#,
            "messages",
        );
        assert_eq!(spaced.hashes(), want);
    }

    #[test]
    fn body_and_tools_keys_follow_their_bytes() {
        let a = split_body(
            br#"{"model":"m","tools":[{"x":1}],"messages":[{"a":1}]}"#,
            "messages",
        )
        .unwrap();
        let b = split_body(
            br#"{"model":"m","tools":[{"x":1}],"messages":[{"b":2},{"c":3}]}"#,
            "messages",
        )
        .unwrap();
        let c = split_body(
            br#"{"model":"n","tools":[{"x":2}],"messages":[{"a":1}]}"#,
            "messages",
        )
        .unwrap();
        // Other items, same body: same key; other parameters: another key.
        assert_eq!(a.body_key, b.body_key);
        assert_ne!(a.body_key, c.body_key);
        // The same parameters in other bytes: another key (same hash later).
        let spaced = split_body(
            br#"{"model":"m", "tools":[{"x":1}],"messages":[{"a":1}]}"#,
            "messages",
        )
        .unwrap();
        assert_ne!(a.body_key, spaced.body_key);
        // Tools before or after the items, or none: all told apart.
        let after = split_body(
            br#"{"model":"m","messages":[{"a":1}],"tools":[{"x":1}]}"#,
            "messages",
        )
        .unwrap();
        let none = split_body(br#"{"model":"m","messages":[{"a":1}]}"#, "messages").unwrap();
        let empty = split_body(br#"{"model":"m","messages":[ ]}"#, "messages").unwrap();
        assert_ne!(a.body_key, after.body_key);
        assert_ne!(none.body_key, empty.body_key);
        let key = |s: &SplitBody| s.tools.as_ref().unwrap().1;
        assert_eq!(key(&a), *blake3::hash(br#"[{"x":1}]"#).as_bytes());
        assert_ne!(key(&a), key(&c));
        // The tools stay bytes, `null` in the body until restored.
        assert_eq!(a.body["tools"], Value::Null);
        let raw = Bytes::from_static(br#"{"model":"m","tools":[{"x":1}],"messages":[{"a":1}]}"#);
        let (span, k) = a.tools.clone().unwrap();
        let tools = Tools::raw(raw, span, k, caches());
        assert_eq!(tools.hash, item_hash(&json!([{"x": 1}])));
        let mut body = a.body.clone();
        Tools::restore(Some(&tools), &mut body);
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"model":"m","tools":[{"x":1}],"messages":[]}"#
        );
        // From a body parsed whole: the same hash, the same place.
        let mut parsed = body.clone();
        let taken = Tools::take(&mut parsed).unwrap();
        assert_eq!(taken.hash, tools.hash);
        assert_eq!(parsed, a.body);
        let h = cached_hash(a.body_key, || item_hash(&a.body));
        assert_eq!(h, item_hash(&a.body));
        assert_eq!(cached_hash(a.body_key, || unreachable!()), h);
    }

    #[test]
    fn a_repeated_history_reuses_the_hashes_of_the_same_bytes() {
        let scope = "tenant-reuse-test";
        let first = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u1"},{"role":"assistant","content":"a1"}]}"#;
        let (_, a) = list(first, "messages");
        let ha = a.hashes_and_chains(scope).0;
        assert_eq!(ha, a.hashes());
        // The next request repeats the history and adds to it; one that
        // differs in an item's bytes gets that item's own hash.
        let next = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u1"},{"role":"assistant","content":"a1"},{"role":"user","content":"u2"}]}"#;
        let (_, b) = list(next, "messages");
        let hb = b.hashes_and_chains(scope).0;
        assert_eq!(hb, b.hashes());
        assert_eq!(hb[..3], ha[..]);
        let edited = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u1"},{"role":"assistant","content":"A1"},{"role":"user","content":"u2"}]}"#;
        let (_, c) = list(edited, "messages");
        let hc = c.hashes_and_chains(scope).0;
        assert_eq!(hc, c.hashes());
        assert_ne!(hc[2], hb[2]);
        // Another scope finds nothing, and computes the same hashes.
        let (_, d) = list(next, "messages");
        assert_eq!(d.hashes_and_chains("another tenant").0, hb);
    }

    /// A body's bytes: members before the items, the items, members
    /// after, with `ws` between tokens.
    fn body_bytes(
        before: &[(String, Value)],
        items: &[Value],
        after: &[(String, Value)],
        ws: &str,
    ) -> Vec<u8> {
        let member =
            |(k, v): &(String, Value)| format!("{}{ws}:{ws}{}", Value::from(k.as_str()), v);
        let mut members: Vec<String> = before.iter().map(member).collect();
        let items: Vec<String> = items.iter().map(|i| i.to_string()).collect();
        members.push(format!(
            "\"messages\"{ws}:{ws}[{ws}{}{ws}]",
            items.join(&format!("{ws},{ws}"))
        ));
        members.extend(after.iter().map(member));
        format!("{{{ws}{}{ws}}}", members.join(&format!("{ws},"))).into_bytes()
    }

    fn same_split(a: &SplitBody, b: &SplitBody) -> bool {
        serde_json::to_string(&a.body).unwrap() == serde_json::to_string(&b.body).unwrap()
            && a.spans == b.spans
            && a.body_key == b.body_key
            && a.tools == b.tools
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]

        /// A body split after the history it repeats from a recent request
        /// is split exactly as a full parse splits it, and its hashes are
        /// the canonical ones, whatever changed between the two requests.
        #[test]
        fn resuming_after_a_repeated_history_splits_as_the_full_parse(
            texts in proptest::collection::vec("[a-z\"\\\\é ]{0,12}", 1..8),
            extra in proptest::collection::vec("[a-z ]{0,8}", 0..4),
            edit in 0usize..7,
            at in 0usize..8,
            heads in 0usize..3,
            tools_before in proptest::bool::ANY,
            ws in proptest::sample::select(vec!["", " ", "\n  "]),
            seed in proptest::num::u64::ANY,
            keep_shell in proptest::bool::ANY,
        ) {
            let item = |i: usize, t: &str| json!({"role": if i.is_multiple_of(2) { "user" } else { "assistant" }, "content": t});
            let items: Vec<Value> = texts.iter().enumerate().map(|(i, t)| item(i, t)).collect();
            let tools = ("tools".to_string(), json!([{"type": "function", "function": {"name": "sh"}}]));
            let model = ("model".to_string(), json!("m"));
            let stream = ("stream".to_string(), json!(true));
            let (mut before, mut after) = (vec![model], vec![stream]);
            if tools_before { before.push(tools) } else { after.push(tools) }
            let scope = format!("resume-test-{seed}");
            let first = Bytes::from(body_bytes(&before, &items, &after, ws));
            let a = split_body_reusing(&first, "messages", &scope).unwrap();
            // Items before the raw ones (Responses' instructions): none, the
            // same in both requests, or another in the second.
            let head = |k: usize| match (heads, k) {
                (0, _) => Vec::new(),
                (1, _) | (2, 1) => vec![json!({"type": "instructions", "text": "be brief"})],
                _ => vec![json!({"type": "instructions", "text": "be thorough"})],
            };
            let (first_hashes, _, first_claims) =
                raw_list(head(1), first.clone(), a.spans.clone().unwrap())
                    .with_reuse(a.reuse)
                    .with_shell(a.shell.filter(|_| keep_shell))
                    .hashes_and_chains(&scope);
            first_claims.all_claimed();

            let mut next = items.clone();
            let (mut before2, mut after2, mut ws2) = (before.clone(), after.clone(), ws);
            match edit {
                // The next turn: new items at the end.
                0 => next.extend(extra.iter().enumerate().map(|(i, t)| item(items.len() + i, t))),
                // An edited item.
                1 => { let i = at % next.len(); next[i] = item(i, "edited"); }
                // History cut short.
                2 => next.truncate(at % next.len()),
                // Another parameter before or after the items.
                3 => before2.push(("temperature".into(), json!(0.5))),
                4 => after2.push(("user".into(), json!(extra.join("")))),
                // The same content in other bytes.
                5 => ws2 = if ws.is_empty() { " " } else { "" },
                // A parameter after the items changed, its length not.
                _ => after2[0].1 = json!(1234),
            }
            let second = Bytes::from(body_bytes(&before2, &next, &after2, ws2));
            let full = split_body(&second, "messages").unwrap();
            let resumed = split_body_reusing(&second, "messages", &scope).unwrap();
            proptest::prop_assert!(same_split(&full, &resumed));
            if edit == 0 && items.len() >= 2 && keep_shell {
                // Only new items at the end: the recent request's shell
                // stands for the bytes around them (the same one, or, with
                // tools after the items, one naming where this body has
                // them).
                let shell = resumed.shell.as_ref().zip(resumed.reuse.as_ref().and_then(|r| r.seen.shell.as_ref()));
                proptest::prop_assert!(shell.is_some_and(|(a, b)| Arc::ptr_eq(a, b)
                    || (a.obj == b.obj && a.body_key == b.body_key && a.tools == resumed.tools)));
            }
            if (edit == 0 || edit == 4) && items.len() >= 2 {
                // Nothing before the end of the repeated items changed (and
                // the first two items, which find the recent request, are
                // the same).
                proptest::prop_assert!(resumed.reuse.is_some());
            }
            let reused = resumed.reuse.is_some();
            let list = raw_list(head(2), second.clone(), resumed.spans.clone().unwrap())
                .with_reuse(resumed.reuse);
            let want = raw_list(head(2), second.clone(), full.spans.unwrap()).hashes();
            let chains = crate::wire::chain_hashes(&want);
            let (hashes, got_chains, claims) = list.hashes_and_chains(&scope);
            // What is taken as claimed is the first request's items.
            for i in claims.known() {
                proptest::prop_assert!(first_hashes.contains(&hashes[i]), "{} not claimed", i);
            }
            if reused && heads < 2 {
                let repeated = (0..items.len().min(next.len()))
                    .take_while(|&i| items[i] == next[i])
                    .count();
                proptest::prop_assert_eq!(claims.known().len(), repeated.min(items.len()));
            }
            proptest::prop_assert_eq!((hashes, got_chains), (want, chains));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(128))]

        /// Finding the first items after a start seen before gives what
        /// reading the body from its start gives, whatever follows it.
        #[test]
        fn known_starts_find_the_items_the_probe_finds(
            description in "[a-z \"\\\\]{1024,1100}",
            edit in 0usize..4,
            items in proptest::collection::vec(
                proptest::sample::select(vec![
                    r#"{"role":"user","content":"a"}"#, r#"{"b":[1,{"c":"]"}]}"#, "7", r#""s,t""#, "[]", "null",
                ]),
                0..4,
            ),
            ws in proptest::sample::select(vec!["", " ", "\n "]),
            tail in proptest::sample::select(vec!["]}", "] , \"x\":1}", "", ",", "]"]),
            seed in proptest::num::u64::ANY,
        ) {
            let scope = format!("heads-test-{seed}");
            let tools = serde_json::to_string(&json!([{"type": "function", "function": {"name": "sh", "description": description}}])).unwrap();
            let head = format!(r#"{{"model":"m","tools":{tools},"messages":["#);
            let first = format!(r#"{head}{{"role":"system","content":"x"}},{{"role":"user","content":"y"}}]}}"#);
            let seeded = probe_items_known(first.as_bytes(), "messages", &scope);
            proptest::prop_assert_eq!(seeded, probe_items(first.as_bytes(), "messages"));
            let mut second_head = head.clone();
            match edit {
                // Another start: a changed byte, one more parameter.
                1 => second_head = second_head.replacen("\"sh\"", "\"sx\"", 1),
                2 => second_head = second_head.replacen("{\"model\"", "{\"n\":1,\"model\"", 1),
                3 => second_head.push_str(ws),
                _ => {}
            }
            let body = format!("{second_head}{}{ws}{tail}", items.join(&format!("{ws},{ws}")));
            proptest::prop_assert_eq!(
                probe_items_known(body.as_bytes(), "messages", &scope),
                probe_items(body.as_bytes(), "messages"),
                "{}", body
            );
        }
    }

    #[test]
    fn repeated_items_count_as_claimed_only_once_their_request_was_recorded() {
        let scope = "claims-test";
        let list = |raw: &'static str| {
            let raw = Bytes::from_static(raw.as_bytes());
            let split = split_body_reusing(&raw, "messages", scope).unwrap();
            raw_list(Vec::new(), raw, split.spans.unwrap()).with_reuse(split.reuse)
        };
        let (_, _, first) =
            list(r#"{"messages":[{"a":1},{"b":2},{"c":3}]}"#).hashes_and_chains(scope);
        let (_, _, second) =
            list(r#"{"messages":[{"a":1},{"b":2},{"c":3},{"d":4}]}"#).hashes_and_chains(scope);
        assert_eq!(second.known(), 0..0, "the first is not recorded yet");
        first.all_claimed();
        assert_eq!(second.known(), 0..3);
        // A request that repeats the second, before the second is recorded.
        let (_, _, third) = list(r#"{"messages":[{"a":1},{"b":2},{"c":3},{"d":4},{"e":5}]}"#)
            .hashes_and_chains(scope);
        assert_eq!(third.known(), 0..0);
        second.all_claimed();
        assert_eq!(third.known(), 0..4);
    }

    /// A conversation's third request and later take over a shell the
    /// first request's split made: the tools after the items are still
    /// found where this request has them.
    #[test]
    fn tools_after_the_items_are_found_in_every_later_request() {
        let scope = "tools-after-items";
        let tools = r#"[{"type":"function","function":{"name":"sh"}}]"#;
        let mut messages = vec![r#"{"role":"user","content":"a"}"#.to_string()];
        for turn in 0..5 {
            let raw = Bytes::from(format!(
                r#"{{"model":"m","messages":[{}],"tools":{tools}}}"#,
                messages.join(",")
            ));
            let split = split_body_reusing(&raw, "messages", scope).unwrap();
            let (span, key) = split.tools.clone().unwrap();
            assert_eq!(&raw[span.clone()], tools.as_bytes(), "turn {turn}");
            let found = Tools::raw(raw.clone(), span, key, caches());
            assert_eq!(
                found.value(),
                &serde_json::from_str::<Value>(tools).unwrap()
            );
            let list = ItemList::raw(Vec::new(), raw, split.spans.unwrap())
                .with_reuse(split.reuse)
                .with_shell(split.shell);
            let (_, _, claims) = list.hashes_and_chains(scope);
            claims.all_claimed();
            messages.push(format!(
                r#"{{"role":"assistant","content":"answer {turn}"}}"#
            ));
        }
    }

    #[test]
    fn resuming_refuses_what_the_full_parse_refuses() {
        let scope = "resume-refusals";
        let first = Bytes::from_static(br#"{"messages":[{"a":1},{"b":2}],"model":"m"}"#);
        let a = split_body_reusing(&first, "messages", scope).unwrap();
        raw_list(Vec::new(), first.clone(), a.spans.unwrap()).hashes_and_chains(scope);
        for bad in [
            &br#"{"messages":[{"a":1},{"b":2},]}"#[..],
            br#"{"messages":[{"a":1},{"b":2},3]}"#,
            br#"{"messages":[{"a":1},{"b":2}]} x"#,
            br#"{"messages":[{"a":1},{"b":2}"#,
        ] {
            assert!(split_body(bad, "messages").is_none());
            assert!(
                split_body_reusing(bad, "messages", scope).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // A repeated item key: the last array wins, as in the full parse.
        let twice = br#"{"messages":[{"a":1},{"b":2}],"messages":[{"c":3}]}"#;
        let resumed = split_body_reusing(twice, "messages", scope).unwrap();
        assert!(resumed.reuse.is_none());
        assert!(same_split(
            &resumed,
            &split_body(twice, "messages").unwrap()
        ));
        // And a well-formed next request does resume.
        let next = br#"{"messages":[{"a":1},{"b":2}, {"c":3}],"model":"m"}"#;
        let resumed = split_body_reusing(next, "messages", scope).unwrap();
        assert_eq!(resumed.reuse.as_ref().map(|r| r.items), Some(2));
        assert!(same_split(&resumed, &split_body(next, "messages").unwrap()));
    }

    #[test]
    fn the_newest_close_match_ends_the_search() {
        let seen = || {
            Arc::new(Seen {
                spans: vec![0..1; 10],
                ..Seen::default()
            })
        };
        let (old, mid, new) = (seen(), seen(), seen());
        let compared = std::cell::Cell::new(0);
        let score = |scores: [usize; 3]| {
            let (old, mid, new) = (old.clone(), mid.clone(), new.clone());
            let compared = &compared;
            move |s: &Seen| {
                compared.set(compared.get() + 1);
                let i = [&old, &mid, &new]
                    .iter()
                    .position(|c| std::ptr::eq(Arc::as_ptr(c), s))
                    .unwrap();
                scores[i]
            }
        };
        let all = || vec![old.clone(), mid.clone(), new.clone()];
        // The newest shares all but its last item: the others are not read.
        let (n, best) = best_candidate(all(), score([10, 10, 9])).unwrap();
        assert_eq!((n, compared.get()), (9, 1));
        assert!(Arc::ptr_eq(&best, &new));
        // A poor newest: the older ones are compared, and the best wins.
        compared.set(0);
        let (n, best) = best_candidate(all(), score([7, 2, 3])).unwrap();
        assert_eq!((n, compared.get()), (7, 3));
        assert!(Arc::ptr_eq(&best, &old));
        assert!(best_candidate(Vec::new(), |_| 1).is_none());
    }

    #[test]
    fn recent_requests_are_bounded() {
        let mut r = Recent::default();
        let big = Bytes::from(vec![b' '; RECENT_BYTES / 3]);
        for i in 0..10u8 {
            r.insert(
                [i % 2; 32],
                Seen {
                    raw: big.clone(),
                    ..Seen::default()
                },
                None,
            );
            assert!(r.by_key.weight() <= RECENT_BYTES);
            assert!(r.by_key.values().all(|q| q.len() <= RECENT_PER_KEY));
        }
        assert!(r.by_key.values().map(|q| q.len()).sum::<usize>() <= 4);
        // The newest request is kept.
        assert_eq!(r.get(&[1; 32]).last().map(|s| s.id), Some(r.next_id));
        // A request that extends a recent one replaces it.
        let mut r = Recent::default();
        let small = Bytes::from_static(b"{}");
        r.insert(
            [7; 32],
            Seen {
                raw: small.clone(),
                ..Seen::default()
            },
            None,
        );
        let first = r.get(&[7; 32])[0].id;
        r.insert(
            [7; 32],
            Seen {
                raw: small.clone(),
                ..Seen::default()
            },
            Some(first),
        );
        assert_eq!(r.get(&[7; 32]).len(), 1);
        assert_eq!(r.by_key.weight(), 2);
    }

    /// Two owners' caches share nothing: what one remembers of a scope's
    /// requests, the other does not find.
    #[test]
    fn two_owners_caches_share_nothing() {
        let (a, b) = (
            Arc::new(ItemCaches::default()),
            Arc::new(ItemCaches::default()),
        );
        let scope = "one-tenant";
        let first = Bytes::from_static(br#"{"messages":[{"a":1},{"b":2}]}"#);
        let split = a.split_body_reusing(&first, "messages", scope).unwrap();
        ItemList::raw(Vec::new(), first.clone(), split.spans.unwrap())
            .with_caches(a.clone())
            .hashes_and_chains(scope);
        let next = br#"{"messages":[{"a":1},{"b":2},{"c":3}]}"#;
        let in_a = a.split_body_reusing(next, "messages", scope).unwrap();
        assert_eq!(in_a.reuse.as_ref().map(|r| r.items), Some(2));
        let in_b = b.split_body_reusing(next, "messages", scope).unwrap();
        assert!(in_b.reuse.is_none(), "b found a's request");
        assert!(b.recent().by_key.is_empty());
        assert!(b.hashes().is_empty(), "a's item hashes are a's");
    }

    #[test]
    fn bodies_that_are_not_item_arrays_are_left_to_the_full_parser() {
        assert!(split_body(b"[1]", "messages").is_none());
        assert!(split_body(b"{\"messages\":[1]}", "messages").is_none());
        assert!(split_body(b"{\"messages\":[{}]} x", "messages").is_none());
        assert!(split_body(b"{\"messages\":[{]}", "messages").is_none());
        assert!(split_body(br#"{"input":"hello"}"#, "input").is_none());
        let s = split_body(br#"{"model":"m"}"#, "messages").unwrap();
        assert!(s.spans.is_none());
    }

    #[test]
    fn head_items_come_first() {
        let bytes = Bytes::from_static(br#"{"input":[{"role":"user","content":"q"}]}"#);
        let spans = split_body(&bytes, "input").unwrap().spans.unwrap();
        let head = vec![json!({"type": "instructions", "content": "be brief"})];
        let items = raw_list(head.clone(), bytes, spans);
        assert_eq!(items.len(), 2);
        assert_eq!(*items.item(0), head[0]);
        assert_eq!(items.json(1), r#"{"role":"user","content":"q"}"#);
        assert_eq!(items.hashes()[0], item_hash(&head[0]));
        assert!(items.may_contain("\"role\""));
        assert!(!items.may_contain("\"compaction"));
        let values = items.into_values();
        assert_eq!(values.len(), 2);
    }
}
