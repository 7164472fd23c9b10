//! What the read hands to identify: the request read and parsed. Not a
//! phase: it calls none.

use serde_json::Value;

use super::control::Control;
use crate::upstream::Payload;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{Api, ItemHash};

/// A request read and parsed: the one representation of its body that the
/// later phases share (the parameters without items, the items, the tools,
/// and the client's bytes while they can still go upstream as they came).
pub(super) struct ReadRequest {
    /// Which API.
    pub api: Api,
    /// Tenant hash.
    pub tenant: String,
    /// The body without its items and tools.
    pub body: Value,
    /// The items, expanded where the proxy stands for them.
    pub items: ItemList,
    /// The tool definitions, if any.
    pub tools: Option<Tools>,
    /// The key of the body's bytes without items, when they are the
    /// client's own (see [`crate::wire::items::ItemCaches::cached_hash`]).
    pub body_key: Option<ItemHash>,
    /// The `previous_response_id` the client gave.
    pub previous: Option<String>,
    /// The bytes that go upstream while no compaction applies: the
    /// client's, or theirs with the stream-usage member spliced in. `None`
    /// when the body must be rebuilt from its parts (an expanded history,
    /// a usage request that cannot be spliced in).
    pub original: Option<Payload>,
    /// The proxy asks for stream usage the client did not ask for.
    pub strip_usage: bool,
    /// The input ended with Codex's in-band `compaction_trigger`.
    pub trigger: bool,
    /// The body's length as received.
    pub raw_len: usize,
    /// The mode it is served in, and whether the client asked for it to be
    /// compacted now.
    pub control: Control,
}
