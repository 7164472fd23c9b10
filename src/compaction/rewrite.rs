//! Applying a compaction: the longest covered prefix that matches is
//! replaced by the stored replacement, byte for byte the same every time.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::computed::Compaction;
use crate::wire::ItemHash;

/// The request as it goes upstream: the replacement, then the original
/// items after the covered prefix.
pub fn rewrite(original: &[Value], c: &Compaction) -> Vec<Value> {
    let mut out =
        Vec::with_capacity(c.replacement.len() + original.len().saturating_sub(c.covered_len));
    out.extend(c.replacement.iter().cloned());
    out.extend(
        original[c.covered_len.min(original.len())..]
            .iter()
            .cloned(),
    );
    out
}

/// A compaction, or what is kept of one to find it: how many leading items
/// it covers.
pub trait Covering {
    /// Number of leading original items it replaces.
    fn covered_len(&self) -> usize;
}

impl Covering for Arc<Compaction> {
    fn covered_len(&self) -> usize {
        self.covered_len
    }
}

/// The longest compaction whose covered prefix equals a prefix of the
/// request; `chains[i]` is the chain hash of the request's first `i + 1` items.
pub fn find<'a, C: Covering, S: std::hash::BuildHasher>(
    chains: &[ItemHash],
    by_chain: &'a HashMap<ItemHash, C, S>,
) -> Option<&'a C> {
    chains
        .iter()
        .enumerate()
        .rev()
        .find_map(|(i, c)| by_chain.get(c).filter(|comp| comp.covered_len() == i + 1))
}

/// Maps a cut in the rewritten view back to the original items: view items
/// past the replacement are original items past the covered prefix.
pub fn view_to_original(view_cut: usize, base: Option<&Compaction>) -> Option<usize> {
    match base {
        None => Some(view_cut),
        Some(b) if view_cut >= b.replacement.len() => {
            Some(b.covered_len + view_cut - b.replacement.len())
        }
        Some(_) => None,
    }
}
