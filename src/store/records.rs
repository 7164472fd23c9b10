//! What the store records and loads: exchanges (and what compaction saved
//! on them), compactions as the registry keeps them, the start-up snapshot
//! and its limits, and the shared store's chain hits and attempts.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::compaction::Compaction;
use crate::wire::{Api, ItemHash, Usage};

/// Where the request's items continue an earlier exchange's items: the first
/// `len` items equal that exchange's request items (and, if `full`, its
/// response items after them). Lets each exchange store only what is new, so
/// a session that resends its history every turn grows the store linearly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixRef {
    /// The earlier exchange.
    pub exchange: i64,
    /// Number of leading items shared with it.
    pub len: usize,
    /// Whether the shared part includes that exchange's response items.
    pub full: bool,
}

/// The bodies of items a record leaves out because they are believed
/// stored, made only if they must be sent after all (seldom: a deletion
/// elsewhere, or a commit that timed out), so a record of a shared store
/// costs no copy of what it does not send.
#[derive(Clone, Default)]
pub struct LeftOut {
    make: Option<Arc<BodiesFn>>,
    /// About how many bytes what `make` keeps holds (the request it
    /// reads them from): counted in the record's footprint, so a backlog
    /// bounded by footprints bounds what it keeps alive.
    held: usize,
}

type BodiesFn = dyn Fn() -> Vec<(ItemHash, String)> + Send + Sync;

impl LeftOut {
    /// Bodies `make` makes when asked, from what holds about `held` bytes.
    pub fn new(
        held: usize,
        make: impl Fn() -> Vec<(ItemHash, String)> + Send + Sync + 'static,
    ) -> Self {
        LeftOut {
            make: Some(Arc::new(make)),
            held,
        }
    }

    /// The bodies made now, for sending (none once taken).
    pub fn take(&mut self) -> Vec<(ItemHash, String)> {
        self.held = 0;
        self.make.take().map(|make| make()).unwrap_or_default()
    }

    /// About how many bytes it keeps alive.
    pub fn held(&self) -> usize {
        self.held
    }
}

impl std::fmt::Debug for LeftOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LeftOut({} bytes held)", self.held)
    }
}

/// One request/response pair, as recorded. In the journal its JSON leaves
/// out the hash lists and item bodies, which follow it as bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExchangeRecord {
    /// Exchange id (assigned by [`Store::next_exchange_id`](super::Store::next_exchange_id)).
    pub id: i64,
    /// Conversation id.
    pub conversation: String,
    /// Whether this exchange opened the conversation.
    pub new_conversation: bool,
    /// Whether its client chains answers by id (its request continued
    /// one by `previous_response_id`): its next turn names this one's.
    #[serde(skip)]
    pub chained_by_id: bool,
    /// The conversation whose recorded prefix, the longest its request
    /// repeats, it left (see `Identified::branched_from`): on a store
    /// several replicas share, a replica goes on in a conversation without
    /// looking up a longer prefix only while no exchange says it left it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branched_from: Option<String>,
    /// The explicit key that names the conversation, if any.
    pub explicit_key: Option<String>,
    /// Salted hash of the client's credential.
    pub tenant: String,
    /// Which API.
    pub api: Api,
    /// The `model` the client asked for.
    pub model: String,
    /// The earlier exchange whose items this request repeats, if any.
    pub prefix: Option<PrefixRef>,
    /// Item hashes after the shared prefix.
    #[serde(skip)]
    pub suffix_items: Vec<ItemHash>,
    /// Number of items in the request.
    pub request_len: usize,
    /// Hash of the request body with its items removed (model, tools, …).
    #[serde(with = "hexed::one")]
    pub params: ItemHash,
    /// Response item hashes.
    #[serde(skip)]
    pub response_items: Vec<ItemHash>,
    /// Item bodies not yet in the store (request items, params, response items).
    #[serde(skip)]
    pub new_items: Vec<(ItemHash, String)>,
    /// The bodies of the other items, those believed stored already (kept
    /// by a store other processes write too): sent after all when that
    /// belief was dropped before the record committed, since a deletion
    /// elsewhere may have taken them (see [`Store::forgets`]).
    ///
    /// [`Store::forgets`]: super::Store::forgets
    #[serde(skip)]
    pub stored_items: LeftOut,
    /// [`Store::forgets`](super::Store::forgets) when its items were
    /// claimed.
    #[serde(skip)]
    pub claimed_at: u64,
    /// In the journal, its client answered: written however long that
    /// takes, never recorded as withheld (set by the store).
    #[serde(skip)]
    pub journaled: bool,
    /// The upstream's id for the answer (`resp_…`, `chatcmpl-…`).
    pub response_id: Option<String>,
    /// Usage the upstream reported.
    pub usage: Option<Usage>,
    /// HTTP status the client received.
    pub status: u16,
    /// Whether the answer was streamed.
    pub streamed: bool,
    /// The answer did not complete (client left, upstream broke off).
    pub partial: bool,
    /// Error text (the upstream's error body, or what broke), if any.
    pub error: Option<String>,
    /// Start time, ms since the Unix epoch.
    pub started_ms: i64,
    /// Time to the last byte, ms.
    pub latency_ms: f64,
    /// Time to the first byte from upstream, ms.
    pub ttfb_ms: Option<f64>,
    /// Chain hash over the request items.
    #[serde(with = "hexed::opt")]
    pub chain_request: Option<ItemHash>,
    /// Chain hash over the request items followed by the response items.
    #[serde(with = "hexed::opt")]
    pub chain_full: Option<ItemHash>,
    /// Chain over the request items and the response items as the client
    /// is likely to send them back, if that differs: memory's alone.
    #[serde(skip)]
    pub chain_echoed: Option<ItemHash>,
    /// The compaction applied to the request, if any.
    pub compaction: Option<String>,
    /// The context window the request was measured against, and where it
    /// came from: views show what the proxy used, not what a config read
    /// later says.
    #[serde(default)]
    pub window: Option<RecordedWindow>,
    /// The ids the client itself sent for its conversation.
    #[serde(default)]
    pub client_ids: ClientIds,
    /// The client, from its `user-agent` (at most [`MAX_CLIENT_CHARS`]).
    #[serde(default)]
    pub client: Option<String>,
    /// For a request that opens its conversation: its first user message,
    /// redacted, at most [`MAX_PREVIEW_CHARS`], so people can tell
    /// conversations apart.
    #[serde(default)]
    pub preview: Option<String>,
    /// What compaction saved on this request, or would have.
    #[serde(default)]
    pub savings: ExchangeSavings,
}

/// What compaction saved on one request, or would have in observe mode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExchangeSavings {
    /// The mode the request was served in.
    #[serde(default)]
    pub mode: crate::config::Mode,
    /// Input tokens the upstream did not receive because a compaction
    /// applied (the proxy's estimate, scaled to the upstream's tokens).
    #[serde(default)]
    pub tokens_saved: u64,
    /// Observe mode: input tokens the compaction the proxy would have
    /// applied would have saved.
    #[serde(default)]
    pub tokens_saved_potential: u64,
    /// Observe mode: that compaction.
    #[serde(default)]
    pub observed_compaction: Option<String>,
    /// `compactor_recall` rounds the proxy answered within the request.
    #[serde(default)]
    pub recall_rounds: u32,
    /// Their input tokens (the usage recorded is the final answer's).
    #[serde(default)]
    pub recall_input_tokens: u64,
    /// Their output tokens.
    #[serde(default)]
    pub recall_output_tokens: u64,
}

/// Item hashes the store keeps per generation (two generations, ~35 MB at
/// most), and the newest items whose hashes it loads at start-up.
pub const KNOWN_ITEMS: usize = 1 << 18;

/// Characters of the tenant hash shown (enough to tell tenants apart).
pub const TENANT_PREFIX: usize = 12;

/// Most characters of a `user-agent` kept as the client's name.
pub const MAX_CLIENT_CHARS: usize = 120;

pub use crate::wire::MAX_CLIENT_ID_CHARS;

/// Most characters of a conversation's first-message preview.
pub const MAX_PREVIEW_CHARS: usize = 160;

/// A context window as recorded with an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedWindow {
    /// Tokens.
    pub tokens: u64,
    /// Where the proxy had it from.
    pub source: crate::windows::Source,
}

pub use crate::wire::ClientIds;

pub use crate::wire::bounded_text;

/// Anything the writer thread persists.
#[derive(Debug, Clone)]
pub enum Record {
    /// A request/response pair.
    Exchange(Box<ExchangeRecord>),
    /// A computed compaction.
    Compaction(Box<Compaction>),
    /// A context window an upstream told.
    Window(crate::windows::Told),
}

/// What start-up needs to rebuild the in-memory conversation index.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Per-store secret that salts tenant hashes.
    pub salt: [u8; 32],
    /// Highest exchange id recorded.
    pub max_exchange_id: i64,
    /// The hashes of the newest [`KNOWN_ITEMS`](super::KNOWN_ITEMS) items stored.
    pub item_hashes: Vec<ItemHash>,
    /// The newest exchanges (as many as [`Limits::exchanges`]), oldest
    /// first, with what the conversation index needs.
    pub exchanges: Vec<IndexedExchange>,
    /// Explicit conversation keys: (tenant, key, conversation), the most
    /// recently seen [`Limits::keys`] at most, oldest first.
    pub keys: Vec<(String, String, String)>,
    /// Whether the store holds more keys than `keys`.
    pub keys_truncated: bool,
    /// Every compaction, oldest first, without its body (replay re-applies
    /// them; a body is read when a request needs it).
    pub compactions: Vec<StoredCompaction>,
    /// The context windows upstreams told.
    pub windows: Vec<crate::windows::Told>,
}

/// What the registry keeps of every stored compaction: enough to find the
/// requests it applies to. Its body is read from the store when used.
#[derive(Debug, Clone)]
pub struct StoredCompaction {
    /// `cmp_…`
    pub id: String,
    /// Tenant it belongs to.
    pub tenant: String,
    /// Conversation it was computed for.
    pub conversation: String,
    /// Number of leading original items it replaces.
    pub covered_len: usize,
    /// Chain hash of those items.
    pub covered_chain: ItemHash,
    /// Unix ms.
    pub created_ms: i64,
    /// A would-be compaction of observe mode, never applied.
    pub observed: bool,
}

impl From<&Compaction> for StoredCompaction {
    fn from(c: &Compaction) -> Self {
        StoredCompaction {
            id: c.id.clone(),
            tenant: c.tenant.clone(),
            conversation: c.conversation.clone(),
            covered_len: c.covered_len,
            covered_chain: c.covered_chain,
            created_ms: c.created_ms,
            observed: c.observed,
        }
    }
}

/// The fields of an exchange the conversation index needs.
#[derive(Debug, Clone)]
pub struct IndexedExchange {
    /// Exchange id.
    pub id: i64,
    /// Conversation id.
    pub conversation: String,
    /// Tenant.
    pub tenant: String,
    /// Number of request items.
    pub request_len: usize,
    /// Number of response items.
    pub response_len: usize,
    /// Chain over the request items.
    pub chain_request: Option<ItemHash>,
    /// Chain over request + response items.
    pub chain_full: Option<ItemHash>,
    /// Chain over the request items and the response items as a client
    /// sends them back, when that differs from `chain_full`: memory's
    /// alone (the store keeps what was answered), so that the next turn of
    /// a session this process served is known to continue it.
    pub chain_echoed: Option<ItemHash>,
    /// The upstream's response id.
    pub response_id: Option<String>,
    /// The earlier exchange whose items its request repeats, if any.
    pub prefix_exchange: Option<i64>,
}

/// How much of the store a start-up loads into memory: set by the code that
/// keeps it (the conversation index), so the store decides no consumer's
/// memory and names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Newest exchanges in [`Snapshot::exchanges`].
    pub exchanges: usize,
    /// Most recently seen explicit keys in [`Snapshot::keys`].
    pub keys: usize,
}

/// A compaction attempt that stored nothing, as a shared store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// Unix ms it ended.
    pub at_ms: i64,
    /// `discarded` or `failed`.
    pub result: String,
    /// Estimated tokens of the request before.
    pub tokens_before: Option<u64>,
    /// Estimated tokens after (what a discarded one would have sent).
    pub tokens_after: Option<u64>,
    /// Why it failed.
    pub error: Option<String>,
}

/// A recorded prefix a request repeats, as
/// [`Reads::look_up`](super::Reads::look_up) finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainHit {
    /// The exchange's conversation.
    pub conversation: String,
    /// Where the request continues the exchange.
    pub prefix: PrefixRef,
    /// Whether the exchange was answered whole.
    pub answered: bool,
    /// Whether no later exchange continued it: a request extending it goes
    /// on from the conversation's tip.
    pub tip: bool,
}

/// Serde forms of item hashes as lowercase hex: compact and legible in the
/// journal.
mod hexed {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::wire::ItemHash;

    fn parse<E: Error>(s: &str) -> Result<ItemHash, E> {
        blake3::Hash::from_hex(s)
            .map(|h| *h.as_bytes())
            .map_err(|e| E::custom(format!("item hash: {e}")))
    }

    fn hex(h: &ItemHash) -> impl AsRef<str> {
        blake3::Hash::from_bytes(*h).to_hex()
    }

    pub mod one {
        use super::*;
        pub fn serialize<S: Serializer>(h: &ItemHash, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(hex(h).as_ref())
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ItemHash, D::Error> {
            parse(&String::deserialize(d)?)
        }
    }

    pub mod opt {
        use super::*;
        pub fn serialize<S: Serializer>(h: &Option<ItemHash>, s: S) -> Result<S::Ok, S::Error> {
            match h {
                Some(h) => s.serialize_some(hex(h).as_ref()),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ItemHash>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| parse(&s))
                .transpose()
        }
    }
}
