//! What every request a compaction applies to would otherwise compute
//! again from its replacement: the replacement's item hashes, and its
//! items as JSON, made on first use and kept with the compaction in
//! memory.

use std::fmt;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde_json::Value;

use crate::wire::{item_hash, responses, Api, ItemHash};

/// The replacement's hashes and JSON, once made. Not stored: a
/// compaction read from the store makes them on its first request.
#[derive(Clone, Default)]
pub struct Made {
    hashes: OnceLock<Arc<Vec<ItemHash>>>,
    json: OnceLock<Json>,
}

/// The replacement's items as JSON, each followed by a comma.
#[derive(Clone)]
struct Json {
    all: Bytes,
    /// Where the second item starts.
    after_first: usize,
    /// The first item is the Responses instructions pseudo-item, which a
    /// Responses body carries in its `instructions`, not in `input`.
    first_is_instructions: bool,
}

impl fmt::Debug for Made {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Made")
            .field("hashes", &self.hashes.get().map(|h| h.len()))
            .field("json", &self.json.get().map(|j| j.all.len()))
            .finish()
    }
}

impl Made {
    /// The canonical hashes of `replacement`'s items ([`item_hash`]).
    pub fn hashes(&self, replacement: &[Value]) -> &Arc<Vec<ItemHash>> {
        self.hashes
            .get_or_init(|| Arc::new(replacement.iter().map(item_hash).collect()))
    }

    /// `replacement`'s items as they go in the item array of an `api`
    /// body, comma-separated, with a comma after the last when items
    /// `follow` (serialised as [`Api::rebuild_body`] does): for Responses
    /// without a leading instructions pseudo-item, which `Api::set_items`
    /// leaves out too. Empty when no item goes.
    pub fn array_json(&self, api: Api, replacement: &[Value], follow: bool) -> Bytes {
        let json = self.json.get_or_init(|| {
            let mut all = Vec::new();
            let mut after_first = 0;
            for (i, item) in replacement.iter().enumerate() {
                // A `Value` always serialises.
                serde_json::to_writer(&mut all, item).unwrap_or_default();
                all.push(b',');
                if i == 0 {
                    after_first = all.len();
                }
            }
            Json {
                all: all.into(),
                after_first,
                first_is_instructions: replacement
                    .first()
                    .is_some_and(responses::is_instructions_item),
            }
        });
        let from = if api == Api::Responses && json.first_is_instructions {
            json.after_first
        } else {
            0
        };
        let to = if follow || from == json.all.len() {
            json.all.len()
        } else {
            json.all.len() - 1
        };
        json.all.slice(from..to)
    }
}
