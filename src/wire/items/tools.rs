//! A request's tool definitions, kept as the client's bytes and parsed
//! only when something must look inside them.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde_json::Value;

use super::reuse::ItemCaches;
use super::seen::parse;
use crate::wire::hash::{item_hash, ItemHash};

/// A request's tool definitions: the client's bytes, parsed on first need,
/// and their canonical hash. While a request carries them here, its body
/// holds `null` in their place ([`Tools::restore`] puts them back).
#[derive(Clone)]
pub struct Tools {
    /// Canonical hash of the definitions.
    pub hash: ItemHash,
    pub(super) json: Arc<RawJson>,
}

pub(super) struct RawJson {
    pub(super) raw: Bytes,
    pub(super) span: Range<usize>,
    pub(super) value: OnceLock<Value>,
}

impl Tools {
    /// The definitions at `span` of `raw` whose bytes hash to `key`, their
    /// hash found through `caches`.
    pub fn raw(raw: Bytes, span: Range<usize>, key: ItemHash, caches: &ItemCaches) -> Tools {
        let json = RawJson {
            raw,
            span,
            value: OnceLock::new(),
        };
        let hash = caches.cached_hash(key, || item_hash(json.value()));
        Tools {
            hash,
            json: Arc::new(json),
        }
    }

    /// Takes the definitions out of a parsed `body` (leaving `null`), if it
    /// has any that are not `null`.
    pub fn take(body: &mut Value) -> Option<Tools> {
        let slot = body.get_mut("tools").filter(|t| !t.is_null())?;
        let value = slot.take();
        Some(Tools {
            hash: item_hash(&value),
            json: Arc::new(RawJson {
                raw: Bytes::new(),
                span: 0..0,
                value: OnceLock::from(value),
            }),
        })
    }

    /// Length of the definitions' JSON: the client's bytes, if it sent them.
    pub fn byte_len(&self) -> usize {
        if self.json.raw.is_empty() {
            serde_json::to_vec(self.value()).map_or(0, |b| b.len())
        } else {
            self.json.span.len()
        }
    }

    /// The edit of `body`, the client's body as read, that adds `added`
    /// after these definitions: an empty range before the array's closing
    /// `]` and what goes there. `None` when these are not `body`'s bytes or
    /// hold no definition (see [`Tools::end_in`]): the body is then rebuilt
    /// around the definitions.
    pub fn appended(&self, body: &Bytes, added: &[Value]) -> Option<(Range<usize>, Bytes)> {
        let at = self.end_in(body)?;
        let mut insert = Vec::new();
        for tool in added {
            insert.push(b',');
            serde_json::to_writer(&mut insert, tool).ok()?;
        }
        Some((at..at, insert.into()))
    }

    /// Where definitions added at the end of these go in `body`: the
    /// offset of the array's closing `]`, when these are its bytes and the
    /// array holds at least one definition (so what goes in starts with a
    /// comma).
    pub fn end_in(&self, body: &Bytes) -> Option<usize> {
        let json = &self.json;
        if json.raw.as_ptr() != body.as_ptr() || json.raw.len() != body.len() {
            return None;
        }
        let bytes = body.get(json.span.clone())?;
        let inner = bytes.strip_prefix(b"[")?.strip_suffix(b"]")?;
        inner
            .iter()
            .any(|b| !b.is_ascii_whitespace())
            .then(|| json.span.end - 1)
    }

    /// The definitions, parsed.
    pub fn value(&self) -> &Value {
        self.json.value()
    }

    /// Puts the definitions back into `body`, in their place.
    pub fn restore(tools: Option<&Tools>, body: &mut Value) {
        if let (Some(t), Some(obj)) = (tools, body.as_object_mut()) {
            obj.insert("tools".into(), t.value().clone());
        }
    }
}

impl RawJson {
    pub(super) fn value(&self) -> &Value {
        self.value
            .get_or_init(|| parse(&self.raw[self.span.clone()]))
    }
}
