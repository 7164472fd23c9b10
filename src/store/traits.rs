//! The backends' interface: [`Backend`] (the writer thread's writes),
//! [`Reads`] (the request path's point reads) and [`Queries`] (the views of
//! whole conversations, written once over [`sql::Sql`]).

use super::error::StoreError;
use super::records::{AttemptRecord, ChainHit, Limits, Record, Snapshot, StoredCompaction};
use super::{query, retention, rows, savings, sql};
use crate::compaction::Compaction;
use crate::wire::ItemHash;

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
    /// `chains[ask.prefix_from..]` (chain hashes of a request's leading
    /// items) of one of the tenant's exchanges, its conversation and where
    /// the request continues it, and
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
    /// The conversation the request goes on in, as far as memory knows
    /// (see [`crate::conversation::ToLookUp::goes_on`]): the prefix is then
    /// looked up only if an exchange recorded that it left that
    /// conversation; else nothing longer is found.
    pub goes_on: Option<String>,
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
