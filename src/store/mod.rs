//! Records: conversations, exchanges and content-addressed items.
//!
//! One interface ([`Backend`]) with an embedded SQLite implementation; a
//! shared backend for several replicas plugs in behind the same trait.
//! All writes go through one writer thread that commits in batches, so the
//! async request path never blocks on the database; a request waits only for
//! the commit of its own exchange, just before its last bytes are released,
//! which is what makes an acknowledged exchange survive a crash.

pub mod query;
pub mod sqlite;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use serde::Serialize;
use tokio::sync::oneshot;

use crate::compaction::Compaction;
use crate::wire::{Api, ItemHash, Usage};

/// Most records the writer commits in one transaction.
const MAX_BATCH: usize = 256;

/// Where the request's items continue an earlier exchange's items: the first
/// `len` items equal that exchange's request items (and, if `full`, its
/// response items after them). Lets each exchange store only what is new, so
/// a session that resends its history every turn grows the store linearly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PrefixRef {
    /// The earlier exchange.
    pub exchange: i64,
    /// Number of leading items shared with it.
    pub len: usize,
    /// Whether the shared part includes that exchange's response items.
    pub full: bool,
}

/// One request/response pair, as recorded.
#[derive(Debug, Clone, Serialize)]
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
    pub suffix_items: Vec<ItemHash>,
    /// Number of items in the request.
    pub request_len: usize,
    /// Hash of the request body with its items removed (model, tools, …).
    pub params: ItemHash,
    /// Response item hashes.
    pub response_items: Vec<ItemHash>,
    /// Item bodies not yet in the store (request items, params, response items).
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
    pub chain_request: Option<ItemHash>,
    /// Chain hash over the request items followed by the response items.
    pub chain_full: Option<ItemHash>,
    /// The compaction applied to the request, if any.
    pub compaction: Option<String>,
}

/// Anything the writer thread persists.
#[derive(Debug, Clone)]
pub enum Record {
    /// A request/response pair.
    Exchange(Box<ExchangeRecord>),
    /// A computed compaction.
    Compaction(Box<Compaction>),
}

/// What start-up needs to rebuild the in-memory conversation index.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Per-store secret that salts tenant hashes.
    pub salt: [u8; 32],
    /// Highest exchange id recorded.
    pub max_exchange_id: i64,
    /// Every stored item hash.
    pub item_hashes: Vec<ItemHash>,
    /// Every exchange, oldest first, with what the index needs.
    pub exchanges: Vec<IndexedExchange>,
    /// Explicit conversation keys: (tenant, key, conversation).
    pub keys: Vec<(String, String, String)>,
    /// Every compaction, oldest first (replay re-applies them).
    pub compactions: Vec<Compaction>,
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
}

/// A storage backend. Called from the writer thread only.
pub trait Backend: Send + 'static {
    /// Loads what start-up needs (creating the salt on first use).
    fn load(&mut self) -> Result<Snapshot, StoreError>;
    /// Writes a batch of records in one transaction.
    fn write(&mut self, batch: &[Record]) -> Result<(), StoreError>;
}

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database reported an error.
    #[error("database: {0}")]
    Db(#[from] rusqlite::Error),
    /// Filesystem trouble (creating the directory…).
    #[error("store io: {0}")]
    Io(#[from] std::io::Error),
    /// The writer thread is gone.
    #[error("store writer stopped")]
    Closed,
}

enum Cmd {
    Write(Record, Option<oneshot::Sender<Result<(), String>>>),
}

/// Handle to the store: cheap to share, writes through the writer thread.
pub struct Store {
    tx: Mutex<mpsc::Sender<Cmd>>,
    known: Mutex<foldhash::HashSet<ItemHash>>,
    next_id: AtomicI64,
}

impl Store {
    /// Starts the writer thread over `backend` and returns the handle plus
    /// what was loaded.
    pub fn start(mut backend: Box<dyn Backend>) -> Result<(Arc<Store>, Snapshot), StoreError> {
        let snapshot = backend.load()?;
        let (tx, rx) = mpsc::channel::<Cmd>();
        std::thread::Builder::new()
            .name("compactor-store".into())
            .spawn(move || writer_loop(backend, rx))?;
        let store = Store {
            tx: Mutex::new(tx),
            known: Mutex::new(snapshot.item_hashes.iter().copied().collect()),
            next_id: AtomicI64::new(snapshot.max_exchange_id + 1),
        };
        Ok((Arc::new(store), snapshot))
    }

    /// A fresh exchange id.
    pub fn next_exchange_id(&self) -> i64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `hash` as stored (or about to be); true if it was not yet.
    pub fn claim_item(&self, hash: &ItemHash) -> bool {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(*hash)
    }

    /// Records an exchange and waits until it is committed.
    pub async fn record(&self, rec: ExchangeRecord) -> Result<(), StoreError> {
        self.write(Record::Exchange(Box::new(rec))).await
    }

    /// Records a compaction and waits until it is committed.
    pub async fn record_compaction(&self, c: Compaction) -> Result<(), StoreError> {
        self.write(Record::Compaction(Box::new(c))).await
    }

    async fn write(&self, rec: Record) -> Result<(), StoreError> {
        let (ack, done) = oneshot::channel();
        self.send(Cmd::Write(rec, Some(ack)))?;
        match done.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::Io(std::io::Error::other(e))),
            Err(_) => Err(StoreError::Closed),
        }
    }

    /// Records an exchange without waiting (used where nothing can wait,
    /// e.g. when a client went away and its stream is being dropped).
    pub fn record_detached(&self, rec: ExchangeRecord) {
        if self
            .send(Cmd::Write(Record::Exchange(Box::new(rec)), None))
            .is_err()
        {
            tracing::error!("store writer stopped; an exchange record was lost");
        }
    }

    fn send(&self, cmd: Cmd) -> Result<(), StoreError> {
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(cmd)
            .map_err(|_| StoreError::Closed)
    }
}

fn writer_loop(mut backend: Box<dyn Backend>, rx: mpsc::Receiver<Cmd>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(cmd) => batch.push(cmd),
                Err(_) => break,
            }
        }
        let (records, acks): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|Cmd::Write(rec, ack)| (rec, ack))
            .unzip();
        let result = backend.write(&records).map_err(|e| e.to_string());
        if let Err(e) = &result {
            tracing::error!(error = %e, records = records.len(), "store write failed");
        }
        for ack in acks.into_iter().flatten() {
            let _ = ack.send(result.clone());
        }
    }
}
