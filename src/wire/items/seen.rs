//! What a request keeps of a recent one it repeats: the recent request's
//! items and hashes ([`Seen`]), the body around them ([`Shell`]), and how
//! much of it a body takes over ([`Reuse`]).

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::wire::hash::ItemHash;

/// What a split finds outside a body's items: the body without them, its
/// tools and key. Kept with a recent request, so that a next request whose
/// bytes outside its items are the same (the same parameters, tools,
/// instructions: a conversation's next turn) takes it over instead of
/// parsing and hashing those bytes again.
pub struct Shell {
    pub(super) obj: Map<String, Value>,
    pub(super) tools: Option<(Range<usize>, ItemHash)>,
    pub(super) body_key: ItemHash,
}

/// A recent request (of the same scope) whose first `items` items a body
/// repeats byte for byte at the same places, found while splitting it.
pub struct Reuse {
    pub(super) key: ItemHash,
    pub(super) seen: Arc<Seen>,
    pub(super) items: usize,
}

/// A recent request's raw items and their hashes.
#[cfg_attr(test, derive(Default))]
pub(super) struct Seen {
    pub(super) id: u64,
    pub(super) raw: Bytes,
    pub(super) spans: Vec<Range<usize>>,
    pub(super) hashes: Vec<ItemHash>,
    /// The chain hash before the raw items (over the request's head).
    pub(super) head_chain: ItemHash,
    /// The chain hashes after each raw item.
    pub(super) chains: Vec<ItemHash>,
    /// What is around its items, when its split found it.
    pub(super) shell: Option<Arc<Shell>>,
    /// Set once the store has claimed all of its items.
    pub(super) claimed: Arc<AtomicBool>,
}

impl Seen {
    /// How many leading items of a body are these, byte for byte and at
    /// the same places (so all the bytes before them are the same, too).
    pub(super) fn leading_items(&self, raw: &[u8]) -> usize {
        let same = common_prefix(&self.raw, raw);
        self.spans.partition_point(|s| s.end <= same)
    }

    /// How many leading items of a request are byte for byte these.
    pub(super) fn matching(&self, raw: &[u8], spans: &[Range<usize>]) -> usize {
        self.spans
            .iter()
            .zip(spans)
            .take_while(|(a, b)| self.raw[(*a).clone()] == raw[(*b).clone()])
            .count()
    }
}

/// Length of the longest common prefix of `a` and `b`.
pub(crate) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut at = 0;
    // Whole blocks compare as slices (memcmp); the first unequal one by
    // smaller blocks, and the first unequal of those byte by byte.
    for block in [4096, 64] {
        while at + block <= n && a[at..at + block] == b[at..at + block] {
            at += block;
        }
    }
    at + a[at..n]
        .iter()
        .zip(&b[at..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// One item from bytes [`split_body`](super::split_body) already parsed once (so valid).
pub(super) fn parse(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::common_prefix;

    proptest! {
        /// The bytes equal from the start, whichever block the first
        /// difference falls in.
        #[test]
        fn common_prefix_counts_the_equal_bytes(
            a in prop::collection::vec(0u8..3, 0..9000),
            at in 0usize..9000,
            by in 0u8..3,
            len in 0usize..9000,
        ) {
            let mut b = a.clone();
            if let Some(x) = b.get_mut(at) {
                *x = by;
            }
            b.truncate(len);
            let naive = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            prop_assert_eq!(common_prefix(&a, &b), naive);
            prop_assert_eq!(common_prefix(&b, &a), naive);
        }
    }
}
