//! Records: conversations, exchanges and content-addressed items.
//!
//! One interface ([`Backend`], [`Reads`], [`Queries`]) with an embedded
//! SQLite implementation and a [`postgres`] one that several replicas share.
//! All writes go through one writer thread that commits in batches, so the
//! async request path never blocks on the database. With SQLite an exchange
//! is appended to the [`journal`] (one write, shared by the exchanges that
//! end in the same turn of the runtime) just before its answer's last bytes
//! are released, which is what makes an acknowledged exchange survive a
//! crash; the writer imports journaled exchanges within `IMPORT_DELAY`. With
//! PostgreSQL there is no journal: the exchange's commit comes first.

pub mod journal;
pub mod postgres;
pub mod postgres_listen;
pub mod postgres_queries;
pub mod postgres_text;
pub mod query;
pub mod retention;
pub mod rows;
pub mod savings;

/// Characters of the tenant hash shown (enough to tell tenants apart).
pub const TENANT_PREFIX: usize = 12;
pub mod sql;
pub mod sqlite;
pub mod sqlite_check;
mod sqlite_queries;

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

pub use journal::Journal;

use crate::bounded::Generations;
use crate::compaction::Compaction;
use crate::wire::{Api, ItemHash, Usage};

/// Most records the writer commits in one transaction. Each new item
/// lands on a random page of the items' hash index, and a commit writes
/// every page it touched to the WAL: the more items one commit holds, the
/// more of them share pages (at 1,024 rather than 256, a fifth to a third
/// less store thread CPU per exchange in the bench's Codex rows). Under
/// load, [`IMPORT_DELAY`] ends a batch before this does.
const MAX_BATCH: usize = 4096;

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

/// One request/response pair, as recorded. In the journal its JSON leaves
/// out the hash lists and item bodies, which follow it as bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExchangeRecord {
    /// Exchange id (assigned by [`Store::next_exchange_id`]).
    pub id: i64,
    /// Conversation id.
    pub conversation: String,
    /// Whether this exchange opened the conversation.
    pub new_conversation: bool,
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
    /// The hashes of the newest [`KNOWN_ITEMS`] items stored.
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

/// A storage backend's writes. Called from the writer thread only.
pub trait Backend: Send + 'static {
    /// Loads what start-up needs (creating the salt on first use), within
    /// `limits`.
    fn load(&mut self, limits: Limits) -> Result<Snapshot, StoreError>;
    /// Writes a batch of records in one transaction.
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError>;
    /// Writes each record of `batch` in a transaction of its own: what the
    /// writer does with a batch [`Backend::write`] refused for a value one
    /// of its records holds ([`StoreError::is_refusal`]), so that record
    /// fails alone. One result per record, in order.
    fn write_each(&mut self, batch: &[Record]) -> Vec<Result<(), StoreError>> {
        let mut down = false;
        batch
            .iter()
            .map(|r| {
                // Once the database fails (not refuses), the rest are not
                // tried: each would wait its own timeout.
                if down {
                    return Err(StoreError::Stalled(
                        "the database failed while the batch went record by record".into(),
                    ));
                }
                let written = self.write(std::slice::from_ref(r));
                down = written.as_ref().is_err_and(|e| !e.is_refusal());
                written
            })
            .collect()
    }
}

/// A storage backend's point reads, the ones the request path makes while
/// the writer thread owns the writes: safe to call from any thread (they
/// block, so async callers run them on a blocking thread). A second backend
/// implements this beside [`Backend`].
pub trait Reads: Queries + Send + Sync + 'static {
    /// The compaction `id`, body included.
    fn compaction(&self, id: &str) -> Option<Compaction>;
    /// The conversation a tenant's explicit key names.
    fn conversation_of_key(&self, tenant: &str, key: &str) -> Option<String>;
    /// The input items a `previous_response_id` continues: the recorded
    /// request and response of the tenant's exchange that answered with
    /// `response_id`, its instructions left out. `None` when the proxy did
    /// not relay that response whole, or any of its items is missing.
    fn response_history(&self, tenant: &str, response_id: &str) -> Option<Vec<serde_json::Value>>;

    /// Whether other processes write the same store: then what this one
    /// keeps in memory is a cache, and what it lacks is looked up with the
    /// methods below. A store only this process writes keeps their
    /// defaults (nothing to find, every claim granted).
    fn shared(&self) -> bool {
        false
    }
    /// The longest recorded prefix among `chains` (chain hashes of a
    /// request's leading items) of one of the tenant's exchanges: its
    /// conversation and where the request continues it.
    fn exchange_by_chain(&self, _tenant: &str, _chains: &[ItemHash]) -> Option<ChainHit> {
        None
    }
    /// The conversation of the tenant's exchange answered with `response_id`.
    fn conversation_of_response(&self, _tenant: &str, _response_id: &str) -> Option<String> {
        None
    }
    /// The tenant's compaction covering the most items, among those whose
    /// covered chain is one of `chains`.
    fn compaction_covering(&self, _tenant: &str, _chains: &[ItemHash]) -> Option<StoredCompaction> {
        None
    }
    /// When the conversation's newest compaction was computed (Unix ms).
    fn newest_compaction_ms(&self, _tenant: &str, _conversation: &str) -> Option<i64> {
        None
    }
    /// Claims the computing of the conversation's next compaction for
    /// `for_ms` (then the claim lapses, so that a process that died while
    /// holding it blocks nobody): false while another process holds it.
    fn claim(&self, _tenant: &str, _conversation: &str, _for_ms: i64) -> bool {
        true
    }
    /// Gives up a claim taken with [`Reads::claim`].
    fn release(&self, _tenant: &str, _conversation: &str) {}

    /// Records a manual compaction of the conversation, for its next
    /// request whichever process serves it: false if one was pending
    /// already. Only a shared store keeps them (a process alone keeps its
    /// own in memory).
    fn request_manual(&self, _conversation: &str) -> Result<bool, StoreError> {
        Err(StoreError::Unsupported {
            backend: "embedded",
            what: "share manual compactions",
        })
    }
    /// Whether a manual compaction of the conversation is recorded and not
    /// yet taken (a read of the store).
    fn manual_pending(&self, _conversation: &str) -> Result<bool, StoreError> {
        Ok(false)
    }
    /// Whether this process has heard of a pending manual compaction of the
    /// conversation: kept in memory, told by the store as requests come,
    /// so the request path asks the store only then.
    fn manual_heard(&self, _conversation: &str) -> bool {
        false
    }
    /// Takes the tenant's pending manual compaction of the conversation:
    /// true for the one process that does, false for any other (which
    /// forgets it heard of one) or when the store cannot be reached.
    fn take_manual(&self, _tenant: &str, _conversation: &str) -> bool {
        false
    }

    /// Keeps the outcome of a compaction attempt that stored nothing
    /// (discarded, failed) where every process reads it, for a store
    /// several share: `compactor compact` asks any replica for it. A store
    /// only this process writes keeps none (its attempts are in memory).
    fn record_attempt(&self, _tenant: &str, _conversation: &str, _attempt: &AttemptRecord) {}
    /// The latest attempt [`Reads::record_attempt`] kept of the
    /// conversation, whichever process made it.
    fn latest_attempt(&self, _tenant: &str, _conversation: &str) -> Option<AttemptRecord> {
        None
    }

    /// Calls `f` with each announcement of a deletion another process
    /// made ([`retention::forgotten`] reads it), for a store several
    /// replicas share; SQLite's deletions are this process's own.
    fn on_forgotten(&self, _f: Box<dyn Fn(&str) + Send + Sync>) {}

    /// The reads a request makes of a store other processes write, before
    /// it is matched: the longest recorded prefix among
    /// `chains[ask.prefix_from..]` (as [`Reads::exchange_by_chain`]) and
    /// the compaction covering the most of `chains[ask.covering_from..]`
    /// (as [`Reads::compaction_covering`]) or else compaction
    /// `ask.body_of`, body included, both in one round trip, awaited
    /// rather than blocking a thread. A lookup left out (`None`) is not
    /// made, and none is made when all are; a store only this process
    /// writes finds nothing.
    fn look_up(&self, _tenant: &str, _chains: &[ItemHash], _ask: LookUp) -> ReadFuture<Found> {
        Box::pin(std::future::ready(Found::default()))
    }
    /// Calls `f` with each compaction stored by any process, as a store
    /// several share announces it (SQLite's are this process's own).
    fn on_compacted(&self, _f: Box<dyn Fn(StoredCompaction) + Send + Sync>) {}
    /// While every compaction stored is announced to this process (see
    /// [`Reads::on_compacted`]): a number that changes whenever it may have
    /// missed one since (its listening connection dropped). `None` while it
    /// may miss some, and for a store that announces none.
    fn hearing(&self) -> Option<u64> {
        None
    }
}

/// The answer of a [`Reads::look_up`], to be awaited.
pub type ReadFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

/// Which lookups a [`Reads::look_up`] makes: each from where in the
/// request's chains, or not at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LookUp {
    /// The longest recorded prefix, among the chains from here on.
    pub prefix_from: Option<usize>,
    /// The compaction covering the most, among the chains from here on.
    pub covering_from: Option<usize>,
    /// A compaction whose body is wanted, if none covering more is found
    /// (the one memory has for the request, without its body).
    pub body_of: Option<String>,
}

/// What a [`Reads::look_up`] found.
#[derive(Debug, Clone, Default)]
pub struct Found {
    /// The longest recorded prefix, if looked up and found.
    pub chain: Option<ChainHit>,
    /// The compaction covering the most (or the one whose body was
    /// asked), body included, if looked up and found.
    pub compaction: Option<Compaction>,
    /// Whether the store answered (false when nothing was asked, or the
    /// read failed: then nothing is known of what it holds).
    pub answered: bool,
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

/// A recorded prefix a request repeats, as [`Reads::exchange_by_chain`]
/// finds it.
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

/// A storage backend's reads of whole conversations, for the admin API,
/// the CLI and the demo: like [`Reads`], safe from any thread and blocking.
/// The views are written once over [`sql::Sql`]; a backend gives the
/// connections they run on.
pub trait Queries {
    /// A connection for reading, of the view's own.
    fn views(&self) -> Result<Box<dyn sql::Sql>, StoreError>;
    /// A connection for deleting, beside a proxy that may be writing.
    fn maintenance(&self) -> Result<Box<dyn sql::Sql>, StoreError> {
        self.views()
    }

    /// The recorded conversations, most recently seen first; at most
    /// `limit` (the admin API's and the CLI's list).
    fn conversations(
        &self,
        config: &crate::config::Config,
        limit: usize,
    ) -> Result<Vec<query::ConversationSummary>, query::QueryError> {
        query::list_conversations(&*self.views()?, config, limit)
    }
    /// A conversation's timeline (`id` exact or a unique prefix).
    fn conversation_detail(
        &self,
        config: &crate::config::Config,
        id: &str,
    ) -> Result<query::ConversationDetail, query::QueryError> {
        query::show(&*self.views()?, config, id)
    }
    /// Everything recorded about a conversation (`id` exact or a unique
    /// prefix).
    fn conversation_export(
        &self,
        config: &crate::config::Config,
        id: &str,
    ) -> Result<query::ConversationExport, query::QueryError> {
        query::export(&*self.views()?, config, id)
    }
    /// The conversation an id or a unique prefix of one names.
    fn resolve_conversation(&self, id: &str) -> Result<String, query::QueryError> {
        query::resolve_id(&*self.views()?, id)
    }
    /// What compaction saved, per conversation, per tenant and in total.
    fn savings(
        &self,
        config: &crate::config::Config,
    ) -> Result<savings::Report, query::QueryError> {
        Ok(savings::report(&*self.views()?, config, None)?)
    }
    /// The conversation a name (id, prefix or client-sent id) names, with
    /// what deleting it needs.
    fn victim(&self, name: &str) -> Result<retention::Victim, query::QueryError> {
        retention::victim(&*self.views()?, name)
    }
    /// Conversations last seen before `cutoff_ms` (Unix ms), at most
    /// `limit`, oldest first, with what deleting them needs.
    fn victims_seen_before(
        &self,
        cutoff_ms: i64,
        limit: usize,
    ) -> Result<Vec<retention::Victim>, query::QueryError> {
        let conn = self.views()?;
        let found = retention::seen_before(&*conn, cutoff_ms, limit)?;
        Ok(retention::victims_of(&*conn, found)?)
    }
    /// Deletes `ids` with what is their own, then the items nothing refers
    /// to any more (beside a proxy that may be writing).
    fn delete_conversations(
        &self,
        ids: &[String],
    ) -> Result<retention::Removed, query::QueryError> {
        Ok(retention::delete_and_prune(&*self.maintenance()?, ids)?)
    }
    /// The newest applied compaction stored for `conversation`, whichever
    /// process computed it (asked of a store several replicas share; a
    /// process's own attempts are in its memory).
    fn latest_compaction(
        &self,
        conversation: &str,
    ) -> Result<Option<Compaction>, query::QueryError> {
        Ok(rows::load_compactions(&*self.views()?, Some(conversation))?
            .into_iter()
            .rfind(|c| !c.observed))
    }
}

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database reported an error.
    #[error("database: {0}")]
    Db(#[from] rusqlite::Error),
    /// PostgreSQL reported an error (or could not be reached).
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// No PostgreSQL connection could be had.
    #[error("postgres pool: {0}")]
    Pool(String),
    /// A PostgreSQL call took longer than its bound.
    #[error("postgres: no answer in time")]
    Timeout,
    /// The database is stalled or down: requests are refused until a
    /// commit succeeds again.
    #[error("postgres: stalled: {0}")]
    Stalled(String),
    /// Filesystem trouble (creating the directory…).
    #[error("store io: {0}")]
    Io(#[from] std::io::Error),
    /// This store does not answer this read yet.
    #[error("the {backend} store cannot {what} yet")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// What was asked of it.
        what: &'static str,
    },
    /// A column held another type than the reader expected.
    #[error("column {index} is not a {wanted}")]
    Column {
        /// The column's index in the row.
        index: usize,
        /// The type the reader wanted.
        wanted: &'static str,
    },
    /// An exchange another one refers to is not in the store.
    #[error("exchange {0} is not in the store")]
    MissingExchange(i64),
    /// The PostgreSQL schema is older than this build's.
    #[error("the database's schema is at version {applied}, this build's at {latest}: start `compactor serve` once to bring it up to date")]
    Schema {
        /// The newest migration applied.
        applied: i32,
        /// The newest this build knows.
        latest: i32,
    },
    /// The writer thread is gone.
    #[error("store writer stopped")]
    Closed,
    /// The commit of a batch failed: the backend's error, shared by every
    /// record of the batch that waited for it.
    #[error("commit failed: {0}")]
    Commit(#[source] Arc<StoreError>),
}

impl StoreError {
    /// Whether the database refused a write for a value a record holds (a
    /// data exception, a constraint, a value past a limit such as an index
    /// row's size), rather than because it could not be reached or is in
    /// trouble: another record of the same batch would have been taken.
    pub fn is_refusal(&self) -> bool {
        match self {
            StoreError::Postgres(e) => e
                .code()
                .is_some_and(|c| matches!(c.code().get(..2), Some("22" | "23" | "54"))),
            StoreError::Commit(e) => e.is_refusal(),
            _ => false,
        }
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => StoreError::Postgres(e),
            other => StoreError::Pool(other.to_string()),
        }
    }
}

/// A conversation's part of a batch: it is created as of its first
/// exchange, last seen (with its model, client and ids) as of its last; its
/// preview is the first one given.
struct ConversationSpan<'a> {
    first: &'a ExchangeRecord,
    last: &'a ExchangeRecord,
    preview: Option<&'a str>,
    client: Option<&'a str>,
    ids: ClientIds,
}

/// The conversations of a batch's exchanges, each once, in the order they
/// first appear (every backend writes them before the exchanges).
fn conversation_spans(batch: &[Record]) -> Vec<(&str, ConversationSpan<'_>)> {
    let mut order: Vec<&str> = Vec::new();
    let mut spans: foldhash::HashMap<&str, ConversationSpan<'_>> = Default::default();
    for rec in batch {
        if let Record::Exchange(e) = rec {
            let span = spans.entry(&e.conversation).or_insert_with(|| {
                order.push(&e.conversation);
                ConversationSpan {
                    first: e,
                    last: e,
                    preview: None,
                    client: None,
                    ids: ClientIds::default(),
                }
            });
            span.last = e;
            span.preview = span.preview.or(e.preview.as_deref());
            span.client = e.client.as_deref().or(span.client);
            let ids = &e.client_ids;
            for (mine, theirs) in [
                (&mut span.ids.header, &ids.header),
                (&mut span.ids.session, &ids.session),
                (&mut span.ids.cache_key, &ids.cache_key),
            ] {
                if theirs.is_some() {
                    mine.clone_from(theirs);
                }
            }
        }
    }
    order
        .into_iter()
        .filter_map(|c| spans.remove(c).map(|span| (c, span)))
        .collect()
}

/// Told when a commit is done (or failed).
type Ack = Box<dyn FnOnce(Result<(), Arc<StoreError>>) + Send>;

enum Cmd {
    /// A journaled exchange: imported with the next batch.
    Import(Record, u64, usize),
    /// A record to commit now (then acknowledged).
    Write(Record, Option<Ack>),
    /// Commit what is pending now, then acknowledge.
    Flush(Ack),
}

/// Handle to the store: cheap to share, writes through the writer thread.
pub struct Store {
    tx: Mutex<mpsc::Sender<Cmd>>,
    /// The writer thread, woken for what must be committed now.
    writer: std::thread::Thread,
    /// Items stored (or on their way), the recent ones: a request's items
    /// found here go without their bodies. One not found (new, or not seen
    /// for long) goes with its body, which the database ignores if it has it.
    known: Mutex<Generations<ItemHash, ()>>,
    backlog: Arc<Backlog>,
    max_backlog: usize,
    next_id: AtomicI64,
    /// Where ids come from when other processes write the same store.
    ids: Option<SharedIds>,
    /// Told how long each commit took (the writer thread calls it).
    commits: Arc<std::sync::OnceLock<CommitObserver>>,
    journal: Option<Arc<Journal>>,
}

/// Told how long a commit took.
pub type CommitObserver = Box<dyn Fn(Duration) + Send + Sync>;

/// The database of a store other processes write too, as the request path
/// sees it.
pub trait SharedDatabase: Send + Sync + 'static {
    /// Reserves a block of exchange ids no other process gets.
    fn reserve_ids(&self) -> Result<std::ops::Range<i64>, StoreError>;
    /// Why the database cannot take a commit now, if it cannot: a commit
    /// has been under way longer than the stall bound, or the last one
    /// failed for want of the database and none has succeeded since.
    /// Answered from memory.
    fn stalled(&self) -> Option<StoreError>;
}

/// Exchange ids of a store shared with other processes: taken from blocks
/// reserved in the database, one round trip per block.
struct SharedIds {
    db: Arc<dyn SharedDatabase>,
    block: Mutex<std::ops::Range<i64>>,
}

/// Where [`Store::stage`] put a record.
enum Journaled<'a> {
    /// Staged in this journal at this sequence number.
    At(&'a Journal, u64),
    /// Not journaled: to be committed.
    Back(Box<ExchangeRecord>),
}

/// Item hashes [`Store`] keeps per generation (two generations, ~35 MB at
/// most), and the newest items whose hashes it loads at start-up.
pub const KNOWN_ITEMS: usize = 1 << 18;

/// How long a journaled exchange may wait for its import: long enough to
/// import in large batches under load (see [`MAX_BATCH`]; at 500 rather
/// than 200 ms, a third less store thread CPU per exchange in the bench's
/// 30 KB Codex rows, some 2,700 records a commit instead of 1,024), short
/// enough that a reader in another process sees it within half a second.
const IMPORT_DELAY: Duration = Duration::from_millis(500);

impl Store {
    /// Starts the writer thread over `backend` and returns the handle plus
    /// what was loaded. With a journal (opened with the records an earlier
    /// run left in it), exchanges are journaled and imported in batches;
    /// the leftovers are imported before anything is loaded.
    pub fn start(
        backend: Box<dyn Backend>,
        journal: Option<(Journal, Vec<ExchangeRecord>)>,
        limits: Limits,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        Self::start_bounded(backend, journal, limits, MAX_BACKLOG_BYTES)
    }

    /// [`Store::start`] for a store other processes write too: no journal
    /// (an exchange is committed before its answer is released), exchange
    /// ids from `db`, and requests refused while `db` is stalled.
    pub fn start_shared(
        backend: Box<dyn Backend>,
        db: Arc<dyn SharedDatabase>,
        limits: Limits,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        let (store, snapshot) = Self::start_bounded(backend, None, limits, MAX_BACKLOG_BYTES)?;
        let mut store = Arc::into_inner(store).ok_or(StoreError::Closed)?;
        store.ids = Some(SharedIds {
            db,
            block: Mutex::new(0..0),
        });
        Ok((Arc::new(store), snapshot))
    }

    /// [`Store::start`] with the backlog bound given (see
    /// [`MAX_BACKLOG_BYTES`]).
    pub(crate) fn start_bounded(
        mut backend: Box<dyn Backend>,
        journal: Option<(Journal, Vec<ExchangeRecord>)>,
        limits: Limits,
        max_backlog: usize,
    ) -> Result<(Arc<Store>, Snapshot), StoreError> {
        let journal = match journal {
            Some((journal, leftovers)) => {
                if !leftovers.is_empty() {
                    tracing::info!(
                        records = leftovers.len(),
                        "importing exchanges journaled before the last stop"
                    );
                    backend.write(&journal::exchanges(leftovers))?;
                }
                journal.leftovers_imported()?;
                Some(Arc::new(journal))
            }
            None => None,
        };
        let snapshot = backend.load(limits)?;
        let (tx, rx) = mpsc::channel::<Cmd>();
        let upkeep = journal.clone();
        let backlog = Arc::new(Backlog::default());
        let drained = backlog.clone();
        let commits: Arc<std::sync::OnceLock<CommitObserver>> = Arc::default();
        let observer = commits.clone();
        let writer = std::thread::Builder::new()
            .name("compactor-store".into())
            .spawn(move || writer_loop(backend, rx, upkeep, drained, observer))?
            .thread()
            .clone();
        let store = Store {
            tx: Mutex::new(tx),
            writer,
            known: Mutex::new({
                let mut known = Generations::new(KNOWN_ITEMS);
                for &h in &snapshot.item_hashes {
                    known.insert(h, ());
                }
                known
            }),
            next_id: AtomicI64::new(snapshot.max_exchange_id + 1),
            ids: None,
            commits,
            backlog,
            max_backlog,
            journal,
        };
        Ok((Arc::new(store), snapshot))
    }

    /// Whether other processes write the same store (then an answer whose
    /// exchange could not be committed must not reach its client).
    pub fn is_shared(&self) -> bool {
        self.ids.is_some()
    }

    /// Whether the store takes an exchange now: an error while a shared
    /// store's database is stalled or down ([`SharedDatabase::stalled`]),
    /// told without asking the database. A request refused here goes
    /// nowhere, so no answer is billed and then withheld.
    pub fn available(&self) -> Result<(), StoreError> {
        match self.ids.as_ref().and_then(|ids| ids.db.stalled()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Has `observe` told the duration of every commit from now on (the
    /// first observer set stays).
    pub fn observe_commits(&self, observe: CommitObserver) {
        let _ = self.commits.set(observe);
    }

    /// A fresh exchange id. Fails only for a shared store whose database
    /// cannot be reached for a new block of ids.
    pub fn next_exchange_id(&self) -> Result<i64, StoreError> {
        let Some(ids) = &self.ids else {
            return Ok(self.next_id.fetch_add(1, Ordering::Relaxed));
        };
        // While the database is stalled (or down) a request is refused at
        // once, before it goes upstream: none waits for it in turn.
        self.available()?;
        let mut block = ids.block.lock().unwrap_or_else(|p| p.into_inner());
        if block.is_empty() {
            *block = ids.db.reserve_ids()?;
        }
        let id = block.start;
        block.start += 1;
        Ok(id)
    }

    /// Forgets which items are stored: after items were deleted, every
    /// record sends its items' bodies again until it is known anew.
    pub fn forget_known_items(&self) {
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = Generations::new(KNOWN_ITEMS);
    }

    /// Marks `hash` as stored (or about to be); true if it was not yet.
    pub fn claim_item(&self, hash: &ItemHash) -> bool {
        self.claim_items(std::slice::from_ref(hash))
            .next()
            .is_some()
    }

    /// [`Store::claim_item`] for several, under one lock: the positions of
    /// those that were not yet stored.
    pub fn claim_items<'a>(&self, hashes: &'a [ItemHash]) -> impl Iterator<Item = usize> + 'a {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let fresh: Vec<usize> = (0..hashes.len())
            .filter(|&i| known.insert(hashes[i], ()).is_none())
            .collect();
        fresh.into_iter()
    }

    /// Records an exchange durably: once this returns `Ok`, the exchange
    /// survives the process being killed. Journaled (one write) when the
    /// store has a journal, else committed.
    pub async fn record(&self, rec: ExchangeRecord) -> Result<(), StoreError> {
        let streamed = rec.streamed;
        match self.stage(rec)? {
            Journaled::At(journal, seq) => {
                // Buffered answers that end in this same turn of the runtime
                // stage theirs meanwhile, and one write takes them all (2–3
                // per write in the bench). Streams end one at a time (their
                // last event comes in on its own), so theirs goes at once.
                if !streamed {
                    tokio::task::yield_now().await;
                }
                journal.write_staged(seq)?;
                // Durable now; the answer waits only while the database is
                // far behind.
                self.backlog.wait_below(self.max_backlog).await;
                Ok(())
            }
            Journaled::Back(rec) => self.write(Record::Exchange(rec)).await,
        }
    }

    /// Records a compaction and waits until it is committed.
    pub async fn record_compaction(&self, c: Compaction) -> Result<(), StoreError> {
        self.write(Record::Compaction(Box::new(c))).await
    }

    /// Persists a context window an upstream told.
    pub async fn record_window(&self, w: crate::windows::Told) -> Result<(), StoreError> {
        self.write(Record::Window(w)).await
    }

    /// Waits until everything recorded before the call is in the database,
    /// for readers of the database in this process.
    pub async fn flush(&self) -> Result<(), StoreError> {
        let (ack, done) = oneshot::channel();
        self.send(Cmd::Flush(Box::new(move |r| {
            let _ = ack.send(r);
        })))?;
        acked(done.await.map_err(|_| StoreError::Closed)?)
    }

    /// [`Store::flush`] for callers that may block their thread.
    pub fn flush_blocking(&self) -> Result<(), StoreError> {
        let (ack, done) = std::sync::mpsc::channel();
        self.send(Cmd::Flush(Box::new(move |r| {
            let _ = ack.send(r);
        })))?;
        acked(done.recv().map_err(|_| StoreError::Closed)?)
    }

    async fn write(&self, rec: Record) -> Result<(), StoreError> {
        let (ack, done) = oneshot::channel();
        let ack: Ack = Box::new(move |r| {
            let _ = ack.send(r);
        });
        self.send(Cmd::Write(rec, Some(ack)))?;
        acked(done.await.map_err(|_| StoreError::Closed)?)
    }

    /// Stages `rec` in the journal and queues its import; gives it back
    /// when there is no journal (any more).
    fn stage(&self, rec: ExchangeRecord) -> Result<Journaled<'_>, StoreError> {
        let Some(journal) = &self.journal else {
            return Ok(Journaled::Back(Box::new(rec)));
        };
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let mut sent = Ok(());
        let staged = journal.stage(rec, |seq, rec| {
            let size = rec.footprint();
            self.backlog.bytes.fetch_add(size, Ordering::AcqRel);
            sent = tx
                .send(Cmd::Import(Record::Exchange(Box::new(rec)), seq, size))
                .map_err(|_| StoreError::Closed);
        })?;
        sent.map(|()| match staged {
            journal::Staged::At(seq) => Journaled::At(journal, seq),
            journal::Staged::Back(rec) => Journaled::Back(rec),
        })
    }

    /// At shutdown: imports what is journaled and hands the store over
    /// (see [`Journal::release`]); exchanges recorded later are committed.
    pub async fn close(&self) -> Result<(), StoreError> {
        let flushed = self.flush().await;
        if let Some(journal) = &self.journal {
            if flushed.is_ok() {
                journal.release();
            }
        }
        flushed
    }

    /// Records an exchange without waiting (used where nothing can wait,
    /// e.g. when a client went away and its stream is being dropped).
    pub fn record_detached(&self, rec: ExchangeRecord) {
        let result = match self.stage(rec) {
            Ok(Journaled::At(journal, seq)) => journal.write_staged(seq).map_err(StoreError::from),
            Ok(Journaled::Back(rec)) => self.send(Cmd::Write(Record::Exchange(rec), None)),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "an exchange record was lost");
        }
    }

    /// Queues `cmd` and, unless it is a journaled exchange (imported with
    /// its batch), wakes the writer for it.
    fn send(&self, cmd: Cmd) -> Result<(), StoreError> {
        let urgent = !matches!(cmd, Cmd::Import(..));
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(cmd)
            .map_err(|_| StoreError::Closed)?;
        if urgent {
            self.writer.unpark();
        }
        Ok(())
    }
}

fn acked(result: Result<(), Arc<StoreError>>) -> Result<(), StoreError> {
    result.map_err(StoreError::Commit)
}

/// Collects records and commits them: journaled ones within
/// [`IMPORT_DELAY`], others (and everything pending) when one must be
/// committed now.
///
/// Between the first journaled record of a batch and its commit the thread
/// parks rather than waiting on the queue, so the records that follow do
/// not wake it one by one; what must be committed now unparks it.
fn writer_loop(
    mut backend: Box<dyn Backend>,
    rx: mpsc::Receiver<Cmd>,
    journal: Option<Arc<Journal>>,
    backlog: Arc<Backlog>,
    commits: Arc<std::sync::OnceLock<CommitObserver>>,
) {
    let mut batch = Pending {
        backlog,
        commits,
        ..Pending::default()
    };
    let mut deadline: Option<Instant> = None;
    let mut open = true;
    while open {
        if batch.records.is_empty() && batch.acks.is_empty() {
            match rx.recv() {
                Ok(cmd) => batch.take(cmd, &mut deadline),
                Err(_) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => batch.take(cmd, &mut deadline),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let due = deadline.is_some_and(|d| Instant::now() >= d);
        let full = batch.records.len() >= MAX_BATCH;
        if !open || !batch.acks.is_empty() || full || due || deadline.is_none() {
            batch.commit(&mut *backend, &journal);
            deadline = None;
        } else if let Some(d) = deadline {
            std::thread::park_timeout(d.saturating_duration_since(Instant::now()));
        }
    }
    // The handle is gone (shutdown): what is pending goes in now.
    batch.commit(&mut *backend, &journal);
}

/// What the next commit writes and acknowledges.
#[derive(Default)]
struct Pending {
    records: Vec<Record>,
    /// Each with the position in `records` of the record it waits for, if
    /// one (a flush waits for them all).
    acks: Vec<(Option<usize>, Ack)>,
    /// Sequence number of the last journaled record in `records`.
    upto: Option<u64>,
    /// Their share of the backlog (journaled records' footprints).
    bytes: usize,
    backlog: Arc<Backlog>,
    commits: Arc<std::sync::OnceLock<CommitObserver>>,
}

impl Pending {
    /// Adds `cmd` to what the next commit writes (and acknowledges).
    fn take(&mut self, cmd: Cmd, deadline: &mut Option<Instant>) {
        match cmd {
            Cmd::Import(rec, seq, size) => {
                self.records.push(rec);
                self.upto = Some(seq);
                self.bytes += size;
                deadline.get_or_insert_with(|| Instant::now() + IMPORT_DELAY);
            }
            Cmd::Write(rec, ack) => {
                self.records.push(rec);
                let at = self.records.len() - 1;
                self.acks.extend(ack.map(|ack| (Some(at), ack)));
                // A detached write has no ack but is committed now too.
                deadline.take();
            }
            Cmd::Flush(ack) => self.acks.push((None, ack)),
        }
    }

    fn commit(&mut self, backend: &mut dyn Backend, journal: &Option<Arc<Journal>>) {
        // One result per record when the batch was refused and its records
        // then went one by one.
        let mut each: Option<Vec<Result<(), Arc<StoreError>>>> = None;
        let result = if self.records.is_empty() {
            Ok(())
        } else {
            let started = Instant::now();
            let mut written = backend.write(&self.records).map_err(Arc::new);
            if let Err(e) = &written {
                if e.is_refusal() && self.records.len() > 1 {
                    tracing::warn!(
                        error = %e,
                        records = self.records.len(),
                        "the database refused a batch: its records go one by one"
                    );
                    let results: Vec<_> = backend
                        .write_each(&self.records)
                        .into_iter()
                        .map(|r| r.map_err(Arc::new))
                        .collect();
                    // The batch as a whole (a flush) failed only if the
                    // database failed, not when it refused a record.
                    written = results
                        .iter()
                        .find_map(|r| r.clone().err().filter(|e| !e.is_refusal()))
                        .map_or(Ok(()), Err);
                    each = Some(results);
                }
            }
            if let Some(observe) = self.commits.get() {
                observe(started.elapsed());
            }
            written
        };
        let refused = each.iter().flatten().filter(|r| r.is_err()).count();
        if refused > 0 {
            tracing::error!(
                records = refused,
                "the database refused records: not stored"
            );
        }
        match (&result, journal, self.upto.take()) {
            (Err(e), _, _) => {
                tracing::error!(error = %e, records = self.records.len(), "store write failed");
                if let Some(j) = journal {
                    // Its records stay journaled for the next start.
                    j.keep();
                }
            }
            (Ok(()), Some(j), _) if refused > 0 => j.keep(),
            (Ok(()), Some(j), Some(seq)) => j.imported(seq),
            _ => {}
        }
        self.records.clear();
        self.backlog.release(std::mem::take(&mut self.bytes));
        for (at, ack) in self.acks.drain(..) {
            let own = at.zip(each.as_ref()).and_then(|(i, each)| each.get(i));
            ack(own.cloned().unwrap_or_else(|| result.clone()));
        }
    }
}

/// Bytes of journaled exchanges waiting for their import, at most, before
/// [`Store::record`] waits for the writer: when the database falls behind
/// (a slow disk, a lock held by another process), answers slow down rather
/// than memory grows. A record's footprint is mostly its new items' text.
const MAX_BACKLOG_BYTES: usize = 256 << 20;

/// Journaled exchanges not yet imported: their bytes, and a wake-up for
/// those waiting for fewer.
#[derive(Default)]
struct Backlog {
    bytes: AtomicUsize,
    drained: tokio::sync::Notify,
}

impl Backlog {
    fn release(&self, bytes: usize) {
        if bytes > 0 {
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
            self.drained.notify_waiters();
        }
    }

    /// Returns once the backlog is at most `max` bytes.
    async fn wait_below(&self, max: usize) {
        // The usual case, without registering as a waiter.
        if self.bytes.load(Ordering::Acquire) <= max {
            return;
        }
        loop {
            let drained = self.drained.notified();
            let mut drained = std::pin::pin!(drained);
            // Registered before the check, so a release in between wakes it.
            drained.as_mut().enable();
            if self.bytes.load(Ordering::Acquire) <= max {
                return;
            }
            drained.await;
        }
    }
}

impl ExchangeRecord {
    /// About how many bytes the record holds.
    fn footprint(&self) -> usize {
        let texts: usize = self.new_items.iter().map(|(_, body)| 32 + body.len()).sum();
        let hashes = 32 * (self.suffix_items.len() + self.response_items.len());
        let strings = self.conversation.len()
            + self.tenant.len()
            + self.model.len()
            + self.error.as_ref().map_or(0, String::len)
            + self.preview.as_ref().map_or(0, String::len)
            + self.client.as_ref().map_or(0, String::len);
        std::mem::size_of::<Self>() + texts + hashes + strings
    }
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
