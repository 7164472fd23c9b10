//! The exchange under way itself: the request as read and the exchange's
//! own parts, how it is opened, what the phases read of it and the small
//! changes named for what they do (applying a compaction and the proxy's
//! tools are in [`super::view`]).

use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::outcome::Outcome;
use super::parts::{Conversation, Digest, Offered, RecallSpent, Rounds, Timing, Upstream};
use crate::app::AppState;
use crate::compaction::{agent_tool, recall, Compaction};
use crate::conversation::Identified;
use crate::engine;
use crate::server::request::ReadRequest;
use crate::wire::items::ItemList;
use crate::wire::{ItemHash, Usage};

/// An exchange between request and completion: the request as read,
/// and the exchange's own parts, each private; the phases read them through
/// the methods below and change them through the methods named for what
/// they do ([`PendingExchange::apply`], [`PendingExchange::withdraw_recall`], ...).
pub struct PendingExchange {
    /// The request as read, whole.
    pub(super) request: ReadRequest,
    /// What its items and parameters hash to.
    pub(super) digest: Digest,
    /// The conversation it belongs to.
    pub(super) conversation: Conversation,
    /// What goes upstream.
    pub(super) upstream: Upstream,
    /// The proxy's own tools it goes with.
    pub(super) offered: Offered,
    /// When it arrived.
    pub(super) timing: Timing,
    /// The record phase, as the driver handed it.
    pub(super) recorder: Recorder,
}

/// The record phase as the driver hands it to an exchange it opens, to
/// run when the exchange ends (the relay and the splice end it while they
/// stream, so the driver cannot call it after them itself).
#[derive(Clone, Copy)]
pub struct Recorder {
    /// Records an exchange, waiting for the commit (see
    /// [`PendingExchange::finish`]).
    pub finish: for<'a> fn(&'a Arc<AppState>, &'a PendingExchange, Outcome) -> BoxFuture<'a, bool>,
    /// Records an exchange without waiting.
    pub detached: fn(&Arc<AppState>, &PendingExchange, Outcome),
}

impl PendingExchange {
    /// Opens exchange `id` of conversation `ident` for `request`, hashed
    /// as `digest`: its items go as they came, with none of the proxy's
    /// tools, which may answer up to `recall_rounds` recall rounds.
    pub(in crate::server) fn open(
        request: ReadRequest,
        id: i64,
        ident: Identified,
        digest: Digest,
        recall_rounds: u32,
        timing: Timing,
        recorder: Recorder,
    ) -> Self {
        Self {
            conversation: Conversation {
                id,
                ident,
                client_compaction: request.marked_client_compaction(),
                deferred: false,
            },
            upstream: Upstream {
                view: request.items().clone(),
                compaction: None,
                observed: None,
                drop_block: false,
                extra: Vec::new(),
                hidden_thinking: false,
            },
            offered: Offered {
                recall: false,
                recall_rounds,
                recall_offered: false,
                recall_withdrawn: false,
                agent_tool: false,
                agent_offered: false,
                spent: RecallSpent::default(),
                rounds: Default::default(),
            },
            request,
            digest,
            timing,
            recorder,
        }
    }

    /// The request as read.
    pub fn request(&self) -> &ReadRequest {
        &self.request
    }

    /// Which conversation (its id).
    pub fn conversation(&self) -> &str {
        &self.conversation.ident.conversation
    }

    /// The hashes of the request's items.
    pub fn hashes(&self) -> &[ItemHash] {
        &self.digest.hashes
    }

    /// The chain hash of each prefix of the request's items.
    pub fn chains(&self) -> &[ItemHash] {
        &self.digest.chains
    }

    /// Whether it is the client's own compaction request.
    pub fn client_compaction(&self) -> bool {
        self.conversation.client_compaction
    }

    /// The items as they go upstream.
    pub fn view(&self) -> &Arc<ItemList> {
        &self.upstream.view
    }

    /// The compaction applied, if any.
    pub fn compaction(&self) -> Option<&Arc<Compaction>> {
        self.upstream.compaction.as_ref()
    }

    /// The recall rounds' calls and answers, after the view.
    pub fn extra(&self) -> &[Value] {
        &self.upstream.extra
    }

    /// Most recall rounds the proxy answers.
    pub fn recall_rounds(&self) -> u32 {
        self.offered.recall_rounds
    }

    /// Whether the request goes with `compactor_recall` now.
    pub fn offers_recall(&self) -> bool {
        self.offered.recall
    }

    /// Whether it went with `compactor_recall` at some point.
    pub fn recall_offered(&self) -> bool {
        self.offered.recall_offered
    }

    /// The proxy's tools the request was offered at some point: their
    /// calls never reach the client.
    pub fn own_tools(&self) -> Vec<&'static str> {
        let recall = self.recall_offered().then_some(recall::TOOL);
        let compact = self.agent_offered().then_some(agent_tool::TOOL);
        recall.into_iter().chain(compact).collect()
    }

    /// Whether the request goes with `compactor_compact` now.
    pub fn offers_agent_tool(&self) -> bool {
        self.offered.agent_tool
    }

    /// Whether it went with `compactor_compact` at some point.
    pub fn agent_offered(&self) -> bool {
        self.offered.agent_offered
    }

    /// The check of the view against the hard limit, with the body's
    /// `bytes` when they are what goes (and the view's hashes, when they
    /// are known without hashing: see `view_hashes`).
    pub fn fit_check(&self, bytes: Option<usize>) -> engine::FitCheck<'_> {
        engine::FitCheck {
            tenant: self.request.tenant(),
            conversation: self.conversation(),
            model: self.request.model(),
            view: self.upstream.view.clone(),
            hashes: self.view_hashes(),
            tools: self.request.tools().cloned(),
            bytes,
        }
    }

    /// Serves the request in observe mode: its conversation is held out
    /// of compaction (`compaction.holdout_ratio`).
    pub fn hold_out(&mut self) {
        self.request.hold_out();
    }

    /// Observe mode: records `c` as the compaction that would have
    /// applied (it never goes upstream).
    pub fn observe(&mut self, c: Option<Arc<Compaction>>) {
        self.upstream.observed = c;
    }

    /// Takes the request as the client's own compaction request (its last
    /// message says so).
    pub fn treat_as_client_compaction(&mut self) {
        self.conversation.client_compaction = true;
    }

    /// A stored compaction waits for its first turn boundary and the
    /// request, inside a turn, goes without it: with `base` (the one it
    /// extends) if given, and the threshold starts no other after it.
    pub fn defer(&mut self, base: Option<Arc<Compaction>>) {
        self.conversation.deferred = true;
        if let Some(b) = base {
            self.apply(b);
        }
    }

    /// Applies stored compaction `c`, due now (at its boundary, or the
    /// request over the hard limit): the request no longer waits for it.
    pub fn apply_due(&mut self, c: Arc<Compaction>) {
        self.conversation.deferred = false;
        self.apply(c);
    }

    /// An earlier answer of the conversation came after a round the proxy
    /// answered itself: this and every later view of the request lets the
    /// API drop thinking signed against that round.
    pub fn mark_hidden_thinking(&mut self) {
        self.upstream.hidden_thinking = true;
        self.upstream.drop_block = true;
    }

    /// Counts a round of the proxy's tools, whose answer reported `usage`.
    pub fn count_round(&mut self, usage: Option<Usage>) {
        self.offered.spent.add(usage);
    }

    /// The rounds of the proxy's tools answered so far.
    pub(in crate::server) fn rounds(&self) -> Rounds {
        self.offered.rounds
    }

    /// Keeps the rounds answered so far.
    pub(in crate::server) fn set_rounds(&mut self, rounds: Rounds) {
        self.offered.rounds = rounds;
    }

    /// A round answered: its calls and answers go after the view.
    pub fn continue_with(&mut self, items: impl IntoIterator<Item = Value>) {
        self.upstream.extra.extend(items);
    }
}
