//! Content addressing: a canonical hash per item and a chained hash per prefix.
//!
//! The canonical form sorts object keys, so two serialisations of the same
//! item (key order, whitespace) hash alike; any change of content does not.
//! A `cache_control` member, at any depth, is left out: a cache breakpoint
//! is a hint to the upstream, not content, and clients move it every turn
//! (Anthropic's advice: on the last block), so an item with it and the same
//! item without it, or with another, are one item.

use std::borrow::Cow;
use std::io::Write;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// A 32-byte BLAKE3 digest.
pub type ItemHash = [u8; 32];

/// Hash of one item's canonical form.
pub fn item_hash(item: &Value) -> ItemHash {
    hash_canonical(|buf| write_canonical(buf, item, Hints::Skipped))
}

/// The key the canonical form leaves out: a cache breakpoint.
const HINT: &str = "cache_control";

/// Whether the canonical form leaves [`HINT`] members out (it does; only
/// [`legacy_item_hash`] keeps them).
#[derive(Clone, Copy, PartialEq)]
enum Hints {
    Skipped,
    Kept,
}

/// The hash an item given as JSON text had in versions whose canonical
/// form kept `cache_control` members: `None` if the text is not JSON.
/// Only to check a body recorded by such a version against its hash.
pub fn legacy_item_hash(json: &[u8]) -> Option<ItemHash> {
    let v: Value = serde_json::from_slice(json).ok()?;
    Some(hash_canonical(|buf| write_canonical(buf, &v, Hints::Kept)))
}

/// [`item_hash`] of an item given as JSON text, read without building a
/// [`Value`] (strings stay borrowed where they have no escapes, objects are
/// lists): `None` if the text is not JSON.
pub fn raw_item_hash(json: &[u8]) -> Option<ItemHash> {
    let node: Node = serde_json::from_slice(json).ok()?;
    Some(hash_canonical(|buf| write_node(buf, &node)))
}

/// The hash of an item given as JSON text: [`raw_item_hash`], or, when no
/// canonical form can be built (a lone surrogate `"\ud800"`, nesting deeper
/// than the parser goes), a hash of the bytes themselves, in a domain of
/// its own. Such an item then is its own bytes: two of them are one item
/// only if they are byte for byte the same, never a shared `null`.
pub fn text_item_hash(json: &[u8]) -> ItemHash {
    raw_item_hash(json).unwrap_or_else(|| {
        *blake3::Hasher::new_derive_key(UNPARSED_CONTEXT)
            .update(json)
            .finalize()
            .as_bytes()
    })
}

/// The key of hashes of items that have no canonical form.
const UNPARSED_CONTEXT: &str = "compactor 2026-12 item bytes without a canonical form";

/// Hashes what `write` puts in the thread's canonical-form buffer.
fn hash_canonical(write: impl FnOnce(&mut Vec<u8>)) -> ItemHash {
    CANONICAL.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        write(&mut buf);
        let hash = *blake3::hash(&buf).as_bytes();
        // Keep a moderate buffer for the next item; let a huge one go.
        if buf.capacity() > MAX_KEPT_BUFFER {
            *buf = Vec::new();
        }
        hash
    })
}

/// Largest canonical-form buffer kept between items, bytes.
const MAX_KEPT_BUFFER: usize = 1 << 20;

thread_local! {
    /// Reused per thread: an item's canonical form is built here, then hashed
    /// in one call (hashing many tiny pieces is several times slower).
    static CANONICAL: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `chain[i]` identifies the prefix `items[..=i]`: each link hashes the
/// previous link with the next item's hash, so equal chains mean equal prefixes.
pub fn chain_hashes(items: &[ItemHash]) -> Vec<ItemHash> {
    let mut out = Vec::with_capacity(items.len());
    let mut prev = [0u8; 32];
    for item in items {
        prev = chain_extend(prev, std::slice::from_ref(item));
        out.push(prev);
    }
    out
}

/// The chain hash after appending `items` to the prefix whose chain is `prev`
/// (all zeros for the empty prefix).
pub fn chain_extend(prev: ItemHash, items: &[ItemHash]) -> ItemHash {
    items.iter().fold(prev, |acc, item| {
        let mut h = blake3::Hasher::new();
        h.update(&acc);
        h.update(item);
        *h.finalize().as_bytes()
    })
}

/// Lowercase hex of a hash.
pub fn hex(hash: &ItemHash) -> String {
    blake3::Hash::from_bytes(*hash).to_hex().to_string()
}

/// The canonical form: a type tag per value, strings and numbers
/// length-prefixed as raw bytes (no escaping to do), object keys sorted.
/// Unambiguous, so equal forms mean equal values; `cache_control` members
/// left out unless `hints` says to keep them.
fn write_canonical(out: &mut Vec<u8>, v: &Value, hints: Hints) {
    match v {
        Value::Null => out.push(b'n'),
        Value::Bool(b) => out.push(if *b { b't' } else { b'f' }),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            write_head(out, b'[', items.len());
            for item in items {
                write_canonical(out, item, hints);
            }
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map
                .iter()
                .filter(|(k, _)| hints == Hints::Kept || k.as_str() != HINT)
                .collect();
            write_head(out, b'{', entries.len());
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (k, v) in entries {
                write_str(out, k);
                write_canonical(out, v, hints);
            }
        }
    }
}

/// A JSON value as [`raw_item_hash`] reads it.
enum Node<'a> {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    /// Members sorted by key (a repeated key: the last one counts, as in
    /// a [`Value`]), `cache_control` left out.
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

impl<'de> Deserialize<'de> for Node<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

/// A key or string, borrowed from the text when it has no escapes.
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(NodeVisitor).and_then(|n| match n {
            Node::String(s) => Ok(Text(s)),
            _ => Err(de::Error::custom("expected a string")),
        })
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }

    fn visit_none<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Node<'de>, E> {
        Ok(Node::Bool(b))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Node<'de>, E> {
        Ok(Node::Number(n.into()))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Node<'de>, E> {
        Ok(Node::Number(n.into()))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Node<'de>, E> {
        // As `Value` reads it: a number JSON cannot hold becomes null.
        Ok(serde_json::Number::from_f64(n).map_or(Node::Null, Node::Number))
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Borrowed(s)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Owned(s.to_string())))
    }

    fn visit_string<E>(self, s: String) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Owned(s)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node<'de>, A::Error> {
        let mut members = Vec::new();
        while let Some(Text(k)) = map.next_key()? {
            if k == HINT {
                map.next_value::<de::IgnoredAny>()?;
                continue;
            }
            members.push((k, map.next_value()?));
        }
        // Sorted by key, a repeated key's last value kept: reversed, the
        // stable sort puts the last one first in its run.
        members.reverse();
        members.sort_by(|a, b| a.0.cmp(&b.0));
        members.dedup_by(|later, first| later.0 == first.0);
        Ok(Node::Object(members))
    }
}

/// [`write_canonical`] of the [`Value`] the node stands for.
fn write_node(out: &mut Vec<u8>, v: &Node) {
    match v {
        Node::Null => out.push(b'n'),
        Node::Bool(b) => out.push(if *b { b't' } else { b'f' }),
        Node::Number(n) => write_number(out, n),
        Node::String(s) => write_str(out, s),
        Node::Array(items) => {
            write_head(out, b'[', items.len());
            for item in items {
                write_node(out, item);
            }
        }
        Node::Object(members) => {
            write_head(out, b'{', members.len());
            for (k, v) in members {
                write_str(out, k);
                write_node(out, v);
            }
        }
    }
}

/// An array's or object's tag and length.
fn write_head(out: &mut Vec<u8>, tag: u8, len: usize) {
    out.push(tag);
    out.extend_from_slice(&(len as u64).to_le_bytes());
}

fn write_number(out: &mut Vec<u8>, n: &serde_json::Number) {
    out.push(b'#');
    // Numbers keep serde_json's canonical text (`1.0` stays `1.0`).
    let mark = out.len();
    out.extend_from_slice(&[0; 8]);
    let _ = write!(out, "{n}");
    let len = (out.len() - mark - 8) as u64;
    out[mark..mark + 8].copy_from_slice(&len.to_le_bytes());
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b's');
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_does_not_matter_content_does() {
        let a: Value = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{ "content" : "hi", "role": "user" }"#).unwrap();
        assert_eq!(item_hash(&a), item_hash(&b));
        assert_ne!(
            item_hash(&a),
            item_hash(&json!({"role":"user","content":"hi!"}))
        );
        // Structure, not just the characters, is hashed.
        assert_ne!(item_hash(&json!(["a,b"])), item_hash(&json!(["a", "b"])));
    }

    /// Any JSON value, with the strings, numbers and keys that matter:
    /// escapes, non-ASCII, keys alike but for case, floats and integers.
    fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            proptest::sample::select(vec![0.0, -0.0, 1.0, 1e300, 2.5e-8]).prop_map(Value::from),
            "[a-c\\\"\n\u{e9}\u{1F600} ]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 40, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::vec((key(), inner), 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A key: short ones alike but for case, or a cache breakpoint's.
    fn key() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![4 => "[aAb\"]{0,3}", 1 => Just(HINT.to_string())]
    }

    /// `v` without its `cache_control` members, at any depth.
    fn without_hints(v: &Value) -> Value {
        match v {
            Value::Array(l) => l.iter().map(without_hints).collect(),
            Value::Object(o) => Value::Object(
                o.iter()
                    .filter(|(k, _)| *k != HINT)
                    .map(|(k, v)| (k.clone(), without_hints(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// `a` inside strings written as `\u0061`.
    fn escape_every_a(text: &str) -> String {
        let (mut out, mut in_string, mut escaped) = (String::new(), false, false);
        for c in text.chars() {
            match (in_string, escaped, c) {
                (true, true, _) => escaped = false,
                (true, false, '\\') => escaped = true,
                (true, false, '"') => in_string = false,
                (true, false, 'a') => {
                    out.push_str("\\u0061");
                    continue;
                }
                (false, _, '"') => in_string = true,
                _ => {}
            }
            out.push(c);
        }
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]

        /// The hash read from the text is the hash of the value, whatever
        /// the serialisation: spacing, escapes, a key given twice.
        #[test]
        fn hashes_from_text_are_the_values_hashes(
            v in any_json(),
            pretty in proptest::bool::ANY,
            repeat in proptest::option::of(("[ab]{1,2}", any_json())),
        ) {
            let mut text = if pretty {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                serde_json::to_string(&v).unwrap()
            };
            // A key given twice (JSON allows it; the last one counts).
            let members = v.as_object().is_some_and(|m| !m.is_empty());
            if let (Some((k, first)), true) = (&repeat, members) {
                let member = format!("{}:{},", serde_json::to_string(k).unwrap(), first);
                text.insert_str(1, &member);
            }
            // Escapes where none are needed.
            let text = escape_every_a(&text);
            let value: Value = serde_json::from_str(&text).unwrap();
            proptest::prop_assert_eq!(raw_item_hash(text.as_bytes()), Some(item_hash(&value)));
        }

        /// A `cache_control` member, wherever it is and whatever it holds,
        /// is not part of the item: from the value and from the text.
        #[test]
        fn breakpoints_are_not_hashed(v in any_json()) {
            // As read back (a float's text need not read as the same float).
            let text = serde_json::to_string(&v).unwrap();
            let v: Value = serde_json::from_str(&text).unwrap();
            let bare = item_hash(&without_hints(&v));
            proptest::prop_assert_eq!(item_hash(&v), bare);
            proptest::prop_assert_eq!(raw_item_hash(text.as_bytes()), Some(bare));
            proptest::prop_assert_eq!(legacy_item_hash(text.as_bytes()), Some(
                hash_canonical(|buf| write_canonical(buf, &v, Hints::Kept))));
        }
    }

    #[test]
    fn a_message_whose_breakpoint_moved_is_the_same_item() {
        let block = |cc: Option<Value>| {
            let mut b = json!({"type": "text", "text": "Run the tests."});
            if let Some(cc) = cc {
                b["cache_control"] = cc;
            }
            json!({"role": "user", "content": [b]})
        };
        let bare = item_hash(&block(None));
        for cc in [
            json!({"type": "ephemeral"}),
            json!({"type": "ephemeral", "ttl": "1h"}),
            Value::Null,
        ] {
            let marked = block(Some(cc));
            assert_eq!(item_hash(&marked), bare, "{marked}");
            assert_eq!(
                text_item_hash(marked.to_string().as_bytes()),
                bare,
                "{marked}"
            );
        }
        // Even spelt with an escape, given twice, or holding what no value holds.
        let odd = br#"{"content":[{"text":"Run the tests.","type":"text","cache\u005fcontrol":1,"cache_control":{"a":"\ud800"}}],"role":"user"}"#;
        assert_eq!(raw_item_hash(odd), Some(bare));
        // What the hint sits beside still counts.
        assert_ne!(
            item_hash(&json!({"role": "user", "content": [{"type": "text", "text": "Run them."}]})),
            bare
        );
        // The form earlier versions hashed kept it.
        assert_ne!(
            legacy_item_hash(
                block(Some(json!({"type": "ephemeral"})))
                    .to_string()
                    .as_bytes()
            ),
            Some(bare)
        );
        assert_eq!(
            legacy_item_hash(block(None).to_string().as_bytes()),
            Some(bare)
        );
    }

    #[test]
    fn hashes_from_text_of_what_is_not_json() {
        assert_eq!(raw_item_hash(b"{\"a\":"), None);
        assert_eq!(
            raw_item_hash(b"{\"a\":1,\"a\":2}"),
            Some(item_hash(&json!({"a": 2})))
        );
    }

    #[test]
    fn items_without_a_canonical_form_hash_as_their_bytes() {
        let deep = |leaf: &str| format!("{}{leaf}{}", "[".repeat(200), "]".repeat(200));
        let unparsable = [
            r#"{"role":"user","content":"\ud800 one"}"#.to_string(),
            r#"{"role":"user","content":"\ud800 two"}"#.to_string(),
            format!(r#"{{"role":"user","content":{}}}"#, deep("1")),
            format!(r#"{{"role":"user","content":{}}}"#, deep("2")),
        ];
        let null = item_hash(&Value::Null);
        let hashes: Vec<ItemHash> = unparsable
            .iter()
            .map(|t| text_item_hash(t.as_bytes()))
            .collect();
        for (text, h) in unparsable.iter().zip(&hashes) {
            assert_eq!(
                raw_item_hash(text.as_bytes()),
                None,
                "{text:.60} has no canonical form"
            );
            assert_ne!(*h, null);
            assert_eq!(*h, text_item_hash(text.as_bytes()), "stable");
        }
        let distinct: std::collections::HashSet<_> = hashes.iter().collect();
        assert_eq!(distinct.len(), hashes.len());
        // What parses keeps its canonical hash.
        let fine = br#"{"b":1, "a":2}"#;
        assert_eq!(text_item_hash(fine), item_hash(&json!({"a": 2, "b": 1})));
    }

    #[test]
    fn chains_identify_prefixes() {
        let items: Vec<ItemHash> = (0..4).map(|i| item_hash(&json!(i))).collect();
        let full = chain_hashes(&items);
        let prefix = chain_hashes(&items[..2]);
        assert_eq!(&full[..2], &prefix[..]);
        let mut swapped = items.clone();
        swapped.swap(0, 1);
        assert_ne!(chain_hashes(&swapped)[3], full[3]);
        assert_eq!(chain_extend(prefix[1], &items[2..]), full[3]);
    }
}
