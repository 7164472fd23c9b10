//! The body parsed once with its item array left as byte ranges: where
//! the items lie, and the body around them.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use serde::de::{self, Deserializer as _, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::seen::{Reuse, Shell};
use crate::wire::hash::ItemHash;

/// A request body parsed with its item array left unparsed.
pub struct SplitBody {
    /// The body; the item array's place holds an empty array.
    pub body: Value,
    /// Byte range of each item in the body, when it has the item field.
    pub spans: Option<Vec<Range<usize>>>,
    /// Key of the body's bytes without the items (its tools by their key),
    /// for [`ItemCaches::cached_hash`](super::ItemCaches::cached_hash) of the body with its tools.
    pub body_key: ItemHash,
    /// The `tools` field's byte range and the hash of those bytes, if the
    /// body has one; `body` holds `null` in its place (see [`Tools`](super::Tools)).
    pub tools: Option<(Range<usize>, ItemHash)>,
    /// The recent request whose start this body repeats, when
    /// [`ItemCaches::split_body_reusing`](super::ItemCaches::split_body_reusing) parsed only what follows it.
    pub reuse: Option<Reuse>,
    /// What the split found outside the items, for [`ItemList::with_shell`](super::ItemList::with_shell).
    pub shell: Option<Arc<Shell>>,
}

/// Parses a JSON object, leaving the array of objects under `key` as byte
/// ranges. `None` when `raw` is not such a body (not JSON, not an object,
/// an item that is not an object): the caller parses it whole and reports
/// what is wrong.
pub fn split_body(raw: &[u8], key: &str) -> Option<SplitBody> {
    let split = parse_split(raw, key)?;
    let base = raw.as_ptr() as usize;
    let span_of = |text: &str| {
        let start = text.as_ptr() as usize - base;
        start..start + text.len()
    };
    let spans = split
        .items
        .map(|items| items.iter().map(|i| span_of(i.get())).collect());
    finish_split(raw, split.obj, spans, split.tools.map(|t| span_of(t.get())))
}

pub(super) fn skip_whitespace(raw: &[u8], mut at: usize) -> usize {
    while raw
        .get(at)
        .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
        at += 1;
    }
    at
}

/// One pass of [`SplitVisitor`] over a whole JSON text.
pub(super) fn parse_split<'de>(raw: &'de [u8], key: &str) -> Option<Split<'de>> {
    let mut de = serde_json::Deserializer::from_slice(raw);
    let split = de.deserialize_map(SplitVisitor { key }).ok()?;
    de.end().ok()?;
    Some(split)
}

/// A split from its parts, spans in `raw`: checks that the items are
/// objects, hashes the tools' bytes and the body's bytes without items.
pub(super) fn finish_split(
    raw: &[u8],
    obj: Map<String, Value>,
    spans: Option<Vec<Range<usize>>>,
    tools: Option<Range<usize>>,
) -> Option<SplitBody> {
    if spans
        .iter()
        .flatten()
        .any(|s| raw.get(s.start) != Some(&b'{'))
    {
        return None;
    }
    let tools = tools.map(|span| {
        let key = *blake3::hash(&raw[span.clone()]).as_bytes();
        (span, key)
    });
    // The body's bytes without the items (from the first item's start to
    // the last one's end) are JSON that parses to `body` with its tools;
    // the tools count by their key, so their bytes are hashed once.
    let rest = match spans.as_deref() {
        Some([first, .., last]) | Some([first @ last]) => [0..first.start, last.end..raw.len()],
        _ => [0..raw.len(), raw.len()..raw.len()],
    };
    let mut body_key = blake3::Hasher::new_derive_key(BODY_KEY_CONTEXT);
    for r in rest {
        // JSON text never holds a NUL byte: the markers cannot be mistaken
        // for a body's bytes, and a key is always 32 bytes.
        match &tools {
            Some((t, key)) if r.start <= t.start && t.end <= r.end => {
                body_key.update(&raw[r.start..t.start]);
                body_key.update(b"\0tools:");
                body_key.update(key);
                body_key.update(&raw[t.end..r.end]);
            }
            _ => {
                body_key.update(&raw[r]);
            }
        }
        body_key.update(b"\0|");
    }
    let body_key = *body_key.finalize().as_bytes();
    // A shell stands for the bytes around the items: it needs items.
    let shell = spans.as_ref().is_some_and(|s| !s.is_empty()).then(|| {
        Arc::new(Shell {
            obj: obj.clone(),
            tools: tools.clone(),
            body_key,
        })
    });
    Some(SplitBody {
        body: Value::Object(obj),
        spans,
        body_key,
        tools,
        reuse: None,
        shell,
    })
}

/// The first one or two items of an array whose first item starts at
/// `at`, if they are plainly there (else the probe decides).
pub(super) fn first_items_at(raw: &[u8], at: usize) -> Option<Vec<Range<usize>>> {
    let item = |at: usize| {
        let at = skip_whitespace(raw, at);
        let mut one = serde_json::Deserializer::from_slice(&raw[at..]).into_iter::<&RawValue>();
        one.next()?.ok()?;
        Some(at..at + one.byte_offset())
    };
    let first = item(at)?;
    let next = skip_whitespace(raw, first.end);
    match raw.get(next)? {
        b']' => Some(vec![first]),
        b',' => Some(vec![first, item(next + 1)?]),
        _ => None,
    }
}

/// The byte ranges of the first two items under `key`, reading no further
/// than their end. `None` when there are none (or the body is no object).
pub(super) fn probe_items(raw: &[u8], key: &str) -> Option<Vec<Range<usize>>> {
    let found = RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_slice(raw);
    // The probe stops the parse with an error once it has what it needs.
    let _ = de.deserialize_map(Probe { key, found: &found });
    let base = raw.as_ptr() as usize;
    let spans: Vec<Range<usize>> = found
        .into_inner()
        .into_iter()
        .map(|(at, len)| at - base..at - base + len)
        .collect();
    (!spans.is_empty()).then_some(spans)
}

pub(super) struct Probe<'f> {
    pub(super) key: &'f str,
    pub(super) found: &'f RefCell<Vec<(usize, usize)>>,
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(k) = map.next_key::<Cow<'de, str>>()? {
            if k == self.key {
                return map.next_value_seed(self);
            }
            map.next_value::<de::IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(item) = seq.next_element::<&'de RawValue>()? {
            let text = item.get();
            let mut found = self.found.borrow_mut();
            found.push((text.as_ptr() as usize, text.len()));
            if found.len() == 2 {
                return Err(de::Error::custom("enough items"));
            }
        }
        Ok(())
    }
}

impl<'de> de::DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

/// Keys of bodies are hashes in a domain of their own: they stand for
/// bytes with the tools' key in place of the tools.
pub(super) const BODY_KEY_CONTEXT: &str = "compactor 2026-11 request parameters without items";

/// What one pass over a body finds.
pub(super) struct Split<'de> {
    pub(super) obj: Map<String, Value>,
    pub(super) items: Option<Vec<&'de RawValue>>,
    /// How many times the item key came (JSON allows repeats; the last wins).
    pub(super) item_arrays: usize,
    pub(super) tools: Option<&'de RawValue>,
}

pub(super) struct SplitVisitor<'k> {
    pub(super) key: &'k str,
}

impl<'de> Visitor<'de> for SplitVisitor<'_> {
    type Value = Split<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Split<'de>, A::Error> {
        let mut split = Split {
            obj: Map::new(),
            items: None,
            item_arrays: 0,
            tools: None,
        };
        while let Some(k) = map.next_key::<String>()? {
            if k == self.key {
                // Anything but an array fails the split; the full parse then
                // takes the body (a Responses `input` string, a wrong type).
                split.items = Some(map.next_value_seed(RawElements)?);
                split.item_arrays += 1;
                split.obj.insert(k, Value::Array(Vec::new()));
            } else if k == "tools" {
                // Tool definitions are large and the same every turn: they
                // stay bytes, and their bytes find their hash, as items' do.
                split.tools = Some(map.next_value()?);
                split.obj.insert(k, Value::Null);
            } else {
                let v: Value = map.next_value()?;
                split.obj.insert(k, v);
            }
        }
        Ok(split)
    }
}

/// An array's elements as raw JSON, in the same pass over the bytes.
pub(super) struct RawElements;

impl<'de> de::DeserializeSeed<'de> for RawElements {
    type Value = Vec<&'de RawValue>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RawElements {
    type Value = Vec<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array")
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            out.push(item);
        }
        Ok(out)
    }
}
