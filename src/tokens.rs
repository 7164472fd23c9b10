//! Token estimates with tiktoken (o200k_base), by section, cached per item.
//!
//! Used where the upstream reports no usage and for the per-exchange
//! accounting line, after the answer, on the accounting thread. Before a
//! request is sent, the fit check takes a bound without the tokenizer
//! ([`TokenCounter::bound`]) and counts only when the bound does not settle
//! it.

pub mod media;
mod pieces;
mod text;

use text::SEALED_FIELD;

use std::borrow::Cow;
use std::sync::{Arc, Mutex, OnceLock};

use serde::Serialize;
use serde_json::Value;
use tiktoken_rs::CoreBPE;

use crate::bounded::Generations;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{Api, ItemHash};

/// Per-message framing overhead OpenAI documents for chat formats.
const PER_ITEM_OVERHEAD: u64 = 4;
/// Most cache entries kept (bounds memory); the least recently used go
/// first ([`Generations`]).
const CACHE_LIMIT: usize = 200_000;

/// Estimated tokens of a request, by section.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Estimate {
    /// Leading system / developer items and `instructions`.
    pub system: u64,
    /// User and assistant messages, tool calls, reasoning.
    pub messages: u64,
    /// Tool results.
    pub tool_outputs: u64,
    /// The `tools` definitions.
    pub tool_definitions: u64,
}

impl Estimate {
    /// Sum of all sections.
    pub fn total(&self) -> u64 {
        self.system + self.messages + self.tool_outputs + self.tool_definitions
    }
}

/// The tokenizer, loaded once per process (it takes a while to build).
static BPE: OnceLock<Option<CoreBPE>> = OnceLock::new();
/// Its split without the lookahead (see [`pieces`]).
static PIECES: OnceLock<Option<pieces::PieceCounter>> = OnceLock::new();

/// Counts tokens; cheap to share.
pub struct TokenCounter {
    cache: Mutex<Generations<ItemHash, Counted>>,
    /// Sums by section of a request's leading items, by the chain hash
    /// after them: a conversation's next request repeats them, and takes
    /// their sums with one look instead of one per item.
    prefixes: Mutex<Generations<(Api, ItemHash), Estimate>>,
    /// Counts of text pieces seen (see [`pieces`]).
    pieces: pieces::PieceCache,
}

impl Default for TokenCounter {
    fn default() -> Self {
        // Two generations of half the limit each: at most the limit kept.
        TokenCounter {
            cache: Mutex::new(Generations::new(CACHE_LIMIT / 2)),
            prefixes: Mutex::new(Generations::new(PREFIX_LIMIT / 2)),
            pieces: pieces::PieceCache::default(),
        }
    }
}

/// How far back from its end a request's chains are looked up among the
/// prefixes counted before (a next turn adds a few items; a regenerated
/// answer drops one).
const PREFIX_LOOKBACK: usize = 16;
/// Most prefix sums kept (bounds memory), the least recently used going first.
const PREFIX_LIMIT: usize = 100_000;

/// What the cache keeps of an item: its tokens and what kind of item it
/// is, so a cached item is never parsed again.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Counted {
    tokens: u64,
    kind: Kind,
}

/// The item facts [`section`] needs, for either API.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Kind {
    system: bool,
    tool_output: bool,
}

impl Kind {
    fn of(item: &Value) -> Kind {
        let role = item.get("role").and_then(Value::as_str).unwrap_or("");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("");
        Kind::from_fields(role, kind)
    }

    fn from_fields(role: &str, kind: &str) -> Kind {
        Kind {
            system: crate::wire::class::is_system(role, kind),
            tool_output: crate::wire::class::is_tool_output(role, kind),
        }
    }

    /// The section an item counts in: the same whatever the API, as the
    /// classification looks at both members.
    fn section(self) -> Section {
        if self.system {
            Section::System
        } else if self.tool_output {
            Section::ToolOutputs
        } else {
            Section::Messages
        }
    }
}

impl TokenCounter {
    /// A counter whose tokenizer loads in the background now, so the first
    /// estimate does not pay for it.
    pub fn new_warm() -> Arc<Self> {
        let me = Arc::new(Self::default());
        if BPE.get().is_none() {
            // On the thread that will count most: the tokenizer's regex
            // keeps a fast path for the first thread that uses it.
            // Loads the tokenizer and builds the split, the way counts go.
            crate::background::Background::global().spawn(|| {
                Self::default().count_text("warm up");
            });
        }
        me
    }

    fn bpe() -> Option<&'static CoreBPE> {
        BPE.get_or_init(|| match tiktoken_rs::o200k_base() {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer unavailable; estimating 4 bytes per token");
                None
            }
        })
        .as_ref()
    }

    /// Tokens of a piece of text.
    pub fn count_text(&self, text: &str) -> u64 {
        let Some(bpe) = Self::bpe() else {
            return text.len().div_ceil(4) as u64;
        };
        match PIECES.get_or_init(pieces::PieceCounter::new) {
            Some(split) => split.count(bpe, text, &self.pieces),
            None => bpe.encode_ordinary(text).len() as u64,
        }
    }

    /// Tokens of one item (its text leaves plus framing), cached by hash.
    pub fn count_item(&self, hash: &ItemHash, item: &Value) -> u64 {
        self.count_item_with(hash, || Cow::Borrowed(item))
    }

    /// Like [`TokenCounter::count_item`], with the item fetched (parsed)
    /// only when its hash is not cached.
    pub fn count_item_with<'a>(
        &self,
        hash: &ItemHash,
        item: impl FnOnce() -> Cow<'a, Value>,
    ) -> u64 {
        self.counted(hash, item).tokens
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations<ItemHash, Counted>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counted<'a>(&self, hash: &ItemHash, item: impl FnOnce() -> Cow<'a, Value>) -> Counted {
        if let Some(c) = self.lock().renew(hash) {
            return *c;
        }
        let counted = self.count_new(&item());
        self.insert([(*hash, counted)]);
        counted
    }

    /// [`TokenCounter::count_new`] for item `i` of `items`, from its JSON
    /// bytes when the list still holds them: the same text, without
    /// building the item's tree (a fifth of the accounting thread's time
    /// went into that). An item with a repeated member may count a few
    /// tokens apart from its parsed form, which keeps the last one only.
    fn count_new_in(&self, items: &ItemList, i: usize) -> Counted {
        let mut text = String::new();
        let facts = items
            .raw_json(i)
            .and_then(|json| text::item_text(json, &mut text));
        // An item that may hold an image or a document is counted from its
        // parsed form, where the block's members are seen together.
        let Some(facts) = facts.filter(|f| !f.media) else {
            return self.count_new(&items.item(i));
        };
        let role = facts.role.as_deref().unwrap_or("");
        let kind = facts.kind.as_deref().unwrap_or("");
        let sealed_tokens = match facts.sealed {
            Some((at, sealed)) if is_sealed_kind(kind) => {
                text::take_out(&mut text, at);
                sealed_tokens(sealed.len())
            }
            Some((at, other)) => {
                text::put_back(&mut text, at, &other);
                0
            }
            None => 0,
        };
        Counted {
            tokens: self.count_text(&text) + sealed_tokens + PER_ITEM_OVERHEAD,
            kind: Kind::from_fields(role, kind),
        }
    }

    /// Counts an item the cache does not hold.
    fn count_new(&self, item: &Value) -> Counted {
        let mut text = Text::default();
        let sealed = sealed_content(item);
        match (sealed, item) {
            // The sealed payload is not text the model reads as such: it
            // is estimated from its length, the rest of the item counted.
            (Some(_), Value::Object(fields)) => fields
                .iter()
                .filter(|(k, _)| k.as_str() != SEALED_FIELD)
                .for_each(|(_, v)| text.collect(v)),
            _ => text.collect(item),
        }
        let sealed_tokens = sealed.map_or(0, |s| sealed_tokens(s.len()));
        Counted {
            tokens: self.count_text(&text.text) + text.media + sealed_tokens + PER_ITEM_OVERHEAD,
            kind: Kind::of(item),
        }
    }

    fn insert(&self, counted: impl IntoIterator<Item = (ItemHash, Counted)>) {
        let mut cache = self.lock();
        for (hash, c) in counted {
            cache.insert(hash, c);
        }
    }

    /// An upper bound of [`TokenCounter::estimate`]'s total without the
    /// tokenizer: items counted before by their tokens, the others by their
    /// bytes. A token is at least one byte, and the text counted of an item
    /// (its string values, space separated) is never longer than its JSON;
    /// an image or document ([`media`]) may be priced above its bytes when
    /// it is given by URL or is tiny (an upstream refusal then compacts).
    pub fn bound(&self, items: &ItemList, hashes: &[ItemHash], tools: Option<&Tools>) -> u64 {
        let cache = self.lock();
        let mut total = 0;
        for i in 0..items.len() {
            total += match hashes.get(i).and_then(|h| cache.get(h)) {
                Some(c) => c.tokens,
                None => items.byte_len(i) as u64 + PER_ITEM_OVERHEAD,
            };
        }
        if let Some(t) = tools {
            total += match cache.get(&t.hash) {
                Some(c) => c.tokens,
                None => t.byte_len() as u64 + PER_ITEM_OVERHEAD,
            };
        }
        total
    }

    /// Estimates a request by section (`hashes`: the items' hashes).
    pub fn estimate(
        &self,
        api: Api,
        items: &ItemList,
        hashes: &[ItemHash],
        tools: Option<&Tools>,
    ) -> Estimate {
        self.estimate_chained(api, items, hashes, None, tools)
    }

    /// [`TokenCounter::estimate`], given also the chain hashes after each
    /// item ([`crate::wire::chain_hashes`]): the sums of the longest prefix
    /// counted before (near the end) are taken as they are, and only the
    /// items after it are looked up one by one.
    pub fn estimate_chained(
        &self,
        api: Api,
        items: &ItemList,
        hashes: &[ItemHash],
        chains: Option<&[ItemHash]>,
        tools: Option<&Tools>,
    ) -> Estimate {
        let n = hashes.len().min(items.len());
        let chains = chains.filter(|c| c.len() == hashes.len()).map(|c| &c[..n]);
        let (from, mut e) = chains
            .and_then(|chains| {
                let known = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
                (1..=n)
                    .rev()
                    .take(PREFIX_LOOKBACK)
                    .find_map(|k| known.get(&(api, chains[k - 1])).map(|e| (k, *e)))
            })
            .unwrap_or_default();
        let hashes = &hashes[from..n];
        // One look at the cache for the rest of the request; the items it
        // lacks are counted without holding it.
        let mut found: Vec<Option<Counted>> = {
            let mut cache = self.lock();
            hashes.iter().map(|h| cache.renew(h).copied()).collect()
        };
        let mut new = Vec::new();
        for (i, slot) in found.iter_mut().enumerate() {
            if slot.is_none() {
                let c = self.count_new_in(items, from + i);
                new.push((hashes[i], c));
                *slot = Some(c);
            }
        }
        if !new.is_empty() {
            self.insert(new);
        }
        // The sums after all items but the last, and after all: the next
        // request of the conversation continues one or the other.
        let mut before_last = e;
        for c in found.into_iter().flatten() {
            before_last = e;
            match c.kind.section() {
                Section::System => e.system += c.tokens,
                Section::Messages => e.messages += c.tokens,
                Section::ToolOutputs => e.tool_outputs += c.tokens,
            }
        }
        if let Some(chains) = chains.filter(|_| n > from) {
            let mut known = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
            known.insert((api, chains[n - 1]), e);
            if n >= 2 && n - 1 > from {
                known.insert((api, chains[n - 2]), before_last);
            }
        }
        if let Some(t) = tools {
            e.tool_definitions = self.count_item_with(&t.hash, || Cow::Borrowed(t.value()));
        }
        e
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    System,
    Messages,
    ToolOutputs,
}

/// An item's encrypted content, if it is a reasoning or compaction item
/// that carries one.
fn sealed_content(item: &Value) -> Option<&str> {
    item.get("type")
        .and_then(Value::as_str)
        .filter(|kind| is_sealed_kind(kind))
        .and_then(|_| item.get(SEALED_FIELD).and_then(Value::as_str))
}

/// Item types whose [`SEALED_FIELD`] is an encrypted payload.
fn is_sealed_kind(kind: &str) -> bool {
    matches!(kind, "reasoning" | "compaction" | "compaction_summary")
}

/// Tokens of an encrypted payload of `len` base64 characters: what it
/// decodes to (three bytes per four characters), less the ~650 bytes of
/// envelope around the content, at four bytes a token (the estimate
/// Codex makes of the same items). Tokenized as text, base64 counts four
/// to five times that (a random payload of 4,000 characters: 2,747 tokens
/// against 588), and costs as much as the rest of a turn's new items.
fn sealed_tokens(len: usize) -> u64 {
    ((len as u64) * 3 / 4).saturating_sub(650).div_ceil(4)
}

/// What an item is counted from: its text, and the tokens of its images,
/// documents and audio ([`media`]), which are not text.
#[derive(Default)]
struct Text {
    text: String,
    media: u64,
}

impl Text {
    /// Appends every string leaf (values, not keys) of `v`, space
    /// separated; a media block adds its estimate instead, and of its
    /// members only a document's `title` and `context`.
    fn collect(&mut self, v: &Value) {
        match v {
            Value::String(s) => self.push(s),
            Value::Array(a) => a.iter().for_each(|x| self.collect(x)),
            Value::Object(m) => match media::block_tokens(m) {
                Some(tokens) => {
                    self.media += tokens;
                    for key in ["title", "context"] {
                        if let Some(s) = m.get(key).and_then(Value::as_str) {
                            self.push(s);
                        }
                    }
                }
                None => m.values().for_each(|x| self.collect(x)),
            },
            _ => {}
        }
    }

    fn push(&mut self, s: &str) {
        if !self.text.is_empty() {
            self.text.push(' ');
        }
        self.text.push_str(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::item_hash;
    use serde_json::json;

    /// An item of either API (an object, as the items of a request whose
    /// bytes are kept must be): the members counting looks at (`role`,
    /// `type`, the sealed field) among others, in any order, holding any
    /// JSON, with strings that need escapes, non-ASCII, or are empty.
    fn any_item() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let text = "[a-c \"\\\n\u{e9}\u{1F600}]{0,8}";
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            text.prop_map(Value::String),
            proptest::sample::select(vec![
                "reasoning",
                "compaction",
                "message",
                "function_call_output",
                "system",
                "developer",
                "tool",
                "user",
                "instructions",
                "image",
                "image_url",
                "input_image",
                "document",
            ])
            .prop_map(Value::from),
        ];
        let value = leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec(("[ab]{1,2}", inner), 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        });
        let key = proptest::sample::select(vec![
            "role",
            "type",
            SEALED_FIELD,
            "content",
            "summary",
            "output",
            "source",
            "image_url",
            "title",
        ]);
        proptest::collection::vec((key, value), 0..6)
            .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
    }

    #[test]
    fn a_sealed_payload_before_its_type_is_still_estimated() {
        let t = TokenCounter::default();
        let sealed = "Ab7+Qz".repeat(700);
        for item in [
            json!({"encrypted_content": sealed, "type": "reasoning", "summary": []}),
            json!({"encrypted_content": sealed, "type": "compaction"}),
            json!({"encrypted_content": sealed, "type": "message", "content": "hi"}),
            json!({"content": "hi", "encrypted_content": "", "type": "message"}),
            json!({"encrypted_content": "", "content": "hi", "type": "message"}),
        ] {
            let raw = bytes::Bytes::from(format!(r#"{{"input":[{item}]}}"#));
            let split = crate::wire::items::split_body(&raw, "input").unwrap();
            let items = ItemList::raw(Vec::new(), raw.clone(), split.spans.unwrap());
            assert_eq!(t.count_new_in(&items, 0), t.count_new(&item), "{item}");
        }
        let reasoning = json!({"encrypted_content": sealed, "type": "reasoning"});
        assert_eq!(
            t.count_new(&reasoning).tokens,
            t.count_new(&json!({"type": "reasoning"})).tokens + sealed_tokens(sealed.len())
        );
    }

    #[test]
    fn sections_are_counted_apart() {
        let t = TokenCounter::default();
        let body = json!({
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hello there"},
                {"role": "tool", "tool_call_id": "c", "content": "a b c d e f g"}
            ],
            "tools": [{"type": "function", "function": {"name": "sh"}}]
        });
        let items: ItemList = Api::Chat.request_items(&body).into();
        let hashes = items.hashes();
        let tools = Tools::take(&mut body.clone());
        let e = t.estimate(Api::Chat, &items, &hashes, tools.as_ref());
        assert!(e.system > PER_ITEM_OVERHEAD, "{e:?}");
        assert!(e.messages > PER_ITEM_OVERHEAD);
        assert!(e.tool_outputs > e.messages, "{e:?}");
        assert!(e.tool_definitions > 0);
        // Cached: the same answer again.
        assert_eq!(t.estimate(Api::Chat, &items, &hashes, tools.as_ref()), e);
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(64))]

        /// A conversation's requests (each continues, or drops the last
        /// items of, one before it, in either API) are estimated with the
        /// sums of the prefixes counted before exactly as without them.
        #[test]
        fn prefix_sums_change_no_estimate(
            steps in proptest::collection::vec(
                (0usize..4, 0usize..3, proptest::bool::ANY, proptest::collection::vec(0usize..6, 0..5)),
                1..12,
            ),
        ) {
            let item = |k: usize, n: usize| match k % 3 {
                0 => serde_json::json!({"role": "user", "content": format!("question {n} about the parser")}),
                1 => serde_json::json!({"role": "tool", "tool_call_id": "c", "content": format!("{n} lines of output")}),
                _ => serde_json::json!({"type": "function_call_output", "call_id": "c", "output": format!("ok {n}")}),
            };
            let t = TokenCounter::default();
            let mut history: Vec<Value> = vec![serde_json::json!({"role": "system", "content": "be brief"})];
            let mut n = 0;
            for (drop, back, responses, add) in steps {
                history.truncate(history.len().saturating_sub(drop).max(back.min(history.len())));
                for k in add {
                    n += 1;
                    history.push(item(k, n));
                }
                let api = if responses { Api::Responses } else { Api::Chat };
                let items: ItemList = history.clone().into();
                let hashes = items.hashes();
                let chains = crate::wire::chain_hashes(&hashes);
                let chained = t.estimate_chained(api, &items, &hashes, Some(&chains), None);
                let fresh = TokenCounter::default().estimate(api, &items, &hashes, None);
                proptest::prop_assert_eq!(chained, fresh);
            }
        }

        /// An item read from its JSON bytes counts as the same item parsed:
        /// its text in the same order, its section, its sealed payload
        /// (before or after its type) estimated or counted alike.
        #[test]
        fn an_item_counts_the_same_from_its_bytes(item in any_item()) {
            let raw = bytes::Bytes::from(format!(r#"{{"input":[{item}]}}"#));
            let split = crate::wire::items::split_body(&raw, "input").unwrap();
            let items = ItemList::raw(Vec::new(), raw.clone(), split.spans.unwrap());
            proptest::prop_assert!(items.raw_json(0).is_some());
            let t = TokenCounter::default();
            proptest::prop_assert_eq!(t.count_new_in(&items, 0), t.count_new(&item));
        }

        /// An item's tokens never exceed its JSON's bytes (plus framing).
        #[test]
        fn an_items_tokens_fit_in_its_bytes(
            texts in proptest::collection::vec(proptest::prelude::any::<String>(), 1..4),
        ) {
            let item = serde_json::json!({"role": "user", "content": texts[0], "name": texts[1..].join("")});
            let raw = bytes::Bytes::from(format!(r#"{{"messages":[{item}]}}"#));
            let split = crate::wire::items::split_body(&raw, "messages").unwrap();
            let items = ItemList::raw(Vec::new(), raw.clone(), split.spans.unwrap());
            let hashes = items.hashes();
            let t = TokenCounter::default();
            let bound = t.bound(&items, &hashes, None);
            let counted = t.count_item(&hashes[0], &items.item(0));
            proptest::prop_assert!(bound >= counted, "{} < {}", bound, counted);
        }
    }

    #[test]
    fn encrypted_reasoning_is_estimated_from_its_length() {
        let t = TokenCounter::default();
        let sealed: String = "gAAAAABoQ7x+Zk2/".repeat(250);
        let reasoning = json!({
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Checking the parser first."}],
            "encrypted_content": sealed,
        });
        let summary_only = json!({
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Checking the parser first."}],
        });
        let with = t.count_item(&item_hash(&reasoning), &reasoning);
        let without = t.count_item(&item_hash(&summary_only), &summary_only);
        // 4000 characters: 3000 bytes, 2350 after the envelope, 588 tokens.
        assert_eq!(with - without, 588);
        assert!(t.count_text(&sealed) > 1000, "as text it counts far more");
        // Another item with a member of that name is text like any other.
        let message = json!({"role": "user", "content": "hi", "encrypted_content": sealed});
        let counted = t.count_item(&item_hash(&message), &message);
        assert!(counted > 1000, "{counted}");
        // A payload shorter than the envelope counts nothing.
        assert_eq!(sealed_tokens(100), 0);
    }

    #[test]
    fn the_bound_without_tokenizer_is_never_below_the_estimate() {
        let raw = bytes::Bytes::from_static(
            br#"{"messages":[{"role":"user","content":"caf\u00e9 \n\"x\" \ud83d\ude00 a  b"},{"role":"tool","content":"1234567890 ;;;; ++++ ////"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"sh","arguments":"{\"cmd\":\"ls -la\"}"}}]}],"tools":[{"type":"function","function":{"name":"sh","description":"run it"}}]}"#,
        );
        let split = crate::wire::items::split_body(&raw, "messages").unwrap();
        let items = ItemList::raw(Vec::new(), raw.clone(), split.spans.unwrap());
        let hashes = items.hashes();
        let tools = split
            .tools
            .map(|(span, key)| Tools::raw(raw.clone(), span, key, &Default::default()));
        let t = TokenCounter::default();
        let cold = t.bound(&items, &hashes, tools.as_ref());
        let e = t.estimate(Api::Chat, &items, &hashes, tools.as_ref());
        assert!(cold >= e.total(), "{cold} < {}", e.total());
        // Counted once, the bound is the estimate.
        assert_eq!(t.bound(&items, &hashes, tools.as_ref()), e.total());
        // Some counted, some not: still above.
        let t = TokenCounter::default();
        t.count_item(&hashes[1], &items.item(1));
        let mixed = t.bound(&items, &hashes, tools.as_ref());
        assert!(mixed >= e.total() && mixed < cold);
    }

    proptest::proptest! {
        /// Token accounting files an item under tool outputs exactly when
        /// compaction treats it as one, and under system exactly when
        /// compaction does, whatever the API: one classification, not two.
        #[test]
        fn sections_follow_the_compaction_classification(
            role in proptest::sample::select(vec![
                "", "system", "developer", "user", "assistant", "tool", "function",
            ]),
            kind in proptest::sample::select(vec![
                "", "message", "instructions", "function_call", "function_call_output",
                "custom_tool_call_output", "reasoning", "image_generation_output",
            ]),
        ) {
            let mut item = serde_json::Map::new();
            if !role.is_empty() {
                item.insert("role".into(), json!(role));
            }
            if !kind.is_empty() {
                item.insert("type".into(), json!(kind));
            }
            let item = Value::Object(item);
            let want = if crate::compaction::items::is_system(&item) {
                Section::System
            } else if crate::compaction::items::is_tool_output(&item) {
                Section::ToolOutputs
            } else {
                Section::Messages
            };
            proptest::prop_assert_eq!(Kind::of(&item).section(), want);
            proptest::prop_assert_eq!(Kind::from_fields(role, kind).section(), want);
        }
    }
}

#[cfg(test)]
mod media_tests {
    use super::*;
    use serde_json::json;

    /// A PNG header of `w` × `h` and `payload` bytes after it, as base64.
    fn png_b64(w: u32, h: u32, payload: usize) -> String {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend(w.to_be_bytes());
        b.extend(h.to_be_bytes());
        b.extend((0..payload).map(|i| (i * 7919 % 251) as u8));
        media::encode_base64(&b)
    }

    #[test]
    fn an_image_counts_what_its_api_charges_from_bytes_or_tree() {
        let png = png_b64(2880, 1800, 300_000);
        let url = format!("data:image/png;base64,{png}");
        let text = json!({"type": "text", "text": "The sidebar:"});
        let cases = [
            (
                Api::Chat,
                "messages",
                json!({"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url}}]}),
                media::openai_image(2880, 1800),
            ),
            (
                Api::Responses,
                "input",
                json!({"role": "user", "content": [{"type": "input_text", "text": "The sidebar:"}, {"image_url": url, "type": "input_image"}]}),
                media::openai_image(2880, 1800),
            ),
            (
                Api::Messages,
                "messages",
                json!({"role": "user", "content": [text, {"source": {"data": png, "media_type": "image/png", "type": "base64"}, "type": "image"}]}),
                media::anthropic_image(2880, 1800),
            ),
        ];
        let t = TokenCounter::default();
        let words = t
            .count_new(&json!({"role": "user", "content": [text]}))
            .tokens;
        for (api, key, item, image) in cases {
            let raw = bytes::Bytes::from(format!(r#"{{"{key}":[{item}]}}"#));
            let split = crate::wire::items::split_body(&raw, key).unwrap();
            let items = ItemList::raw(Vec::new(), raw.clone(), split.spans.unwrap());
            let tree = t.count_new(&item);
            assert_eq!(t.count_new_in(&items, 0), tree, "{api:?}");
            // The image's price, and a word or two of its block's type.
            assert!(tree.tokens >= words + image, "{api:?}: {}", tree.tokens);
            assert!(tree.tokens <= words + image + 4, "{api:?}: {}", tree.tokens);
            let hashes = items.hashes();
            let e = TokenCounter::default().estimate(api, &items, &hashes, None);
            assert_eq!(e.total(), tree.tokens, "{api:?}");
        }
    }
}
