//! The parts of an exchange under way beside the request as read (see
//! [`super::pending::PendingExchange`]), each a small value of its own: the
//! exchange's methods read and change them, the phases only call those.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::compaction::Compaction;
use crate::conversation::Identified;
use crate::wire::items::{Claims, ItemList};
use crate::wire::{ItemHash, Usage};

/// What the request's items and parameters hash to: what names its
/// conversation, and what its record is made of.
pub(in crate::server) struct Digest {
    /// Hash of the body with its tools (the request's parameters).
    pub(super) params: ItemHash,
    /// The items' hashes.
    pub(super) hashes: Arc<Vec<ItemHash>>,
    /// Chain hash of each prefix of the items.
    pub(super) chains: Arc<Vec<ItemHash>>,
    /// Chain hash over all the items (zeros if none).
    pub(super) chain_request: ItemHash,
    /// Which of `hashes` the store has claimed already.
    pub(super) claims: Claims,
    /// The store's count of forgets before `claims` were looked up (see
    /// `Store::forgets`): what they and the record's own claims take for
    /// stored is as of then.
    pub(super) forgets: u64,
}

impl Digest {
    /// The hashes of a request: of its parameters, `params`; of its items,
    /// `hashes`, with their `chains` and `claims` (looked up after the
    /// store had forgotten `forgets` times).
    pub(in crate::server) fn new(
        params: ItemHash,
        hashes: Vec<ItemHash>,
        chains: Vec<ItemHash>,
        claims: Claims,
        forgets: u64,
    ) -> Self {
        Self {
            forgets,
            params,
            chain_request: chains.last().copied().unwrap_or([0; 32]),
            hashes: Arc::new(hashes),
            chains: Arc::new(chains),
            claims,
        }
    }
}

/// The conversation the exchange belongs to, and what it is in it.
pub(super) struct Conversation {
    /// Exchange id.
    pub(super) id: i64,
    /// Which conversation.
    pub(super) ident: Identified,
    /// The client's own compaction request (Codex's `request_kind:
    /// compaction`, Claude Code's summary prompt): it goes as the client
    /// sent it when it fits, else with a stored compaction applied, is
    /// never compacted afresh before the upstream refuses it, and starts
    /// no compaction of its own.
    pub(super) client_compaction: bool,
    /// A stored compaction of the conversation waits for its first turn
    /// boundary, and this request (inside a turn) went without it: the
    /// threshold starts no other after it.
    pub(super) deferred: bool,
}

/// What goes upstream: the items as sent, the compaction they carry, and
/// what the request must ask of the API for them.
pub(super) struct Upstream {
    /// The items as sent upstream (after compaction; the request's items
    /// themselves when none applied).
    pub(super) view: Arc<ItemList>,
    /// The compaction applied, if any.
    pub(super) compaction: Option<Arc<Compaction>>,
    /// Observe mode: the would-be compaction that covers a prefix of the
    /// request (what the proxy would have applied).
    pub(super) observed: Option<Arc<Compaction>>,
    /// Anthropic Messages: the request may hold a thinking block signed
    /// against another prefix than it now has (the compacted request's open
    /// tool loop; the client's own history sent again after a compacted
    /// one was refused), so it asks the API to drop such a block
    /// (`thinking.block_binding`, with its beta).
    pub(super) drop_block: bool,
    /// Items after the view: the recall rounds' calls and answers.
    pub(super) extra: Vec<Value>,
    /// Anthropic Messages with thinking on: an earlier answer of the
    /// conversation came after a round the proxy answered itself (recall,
    /// `compactor_compact`), so its thinking was signed against a prefix
    /// the client's history lacks; every request of the conversation lets
    /// the API drop such a block (see `drop_block`).
    pub(super) hidden_thinking: bool,
}

/// The proxy's own tools the request goes with (`compactor_recall`,
/// `compactor_compact`), and what their rounds cost.
pub(super) struct Offered {
    /// The request goes with the `compactor_recall` tool added.
    pub(super) recall: bool,
    /// Most recall rounds the proxy answers (`compaction.recall_max_rounds`;
    /// 0: the tool is never offered).
    pub(super) recall_rounds: u32,
    /// The tool was offered at some point: every answer is looked at for
    /// calls of it, also after it is withdrawn, so none reaches a client
    /// that never declared it.
    pub(super) recall_offered: bool,
    /// The tool was withdrawn (past the rounds, beside the client's own
    /// calls, an overflow): a later compaction does not offer it again.
    pub(super) recall_withdrawn: bool,
    /// The request goes with the `compactor_compact` tool added.
    pub(super) agent_tool: bool,
    /// The tool was offered at some point: every answer is looked at for
    /// calls of it, also after it is withdrawn.
    pub(super) agent_offered: bool,
    /// What the recall rounds cost.
    pub(super) spent: RecallSpent,
    /// The rounds answered so far, across every send of the request (a
    /// stream spliced after its reasoning comes back once per answer).
    pub(super) rounds: Rounds,
}

/// The rounds a request's answers took so far, kept with the exchange
/// (across every send, and every answer a splice hands back).
#[derive(Debug, Default, Clone, Copy)]
pub(in crate::server) struct Rounds {
    /// Recall rounds answered.
    pub(in crate::server) recall: u32,
    /// Answers whose `compactor_compact` calls were answered.
    pub(in crate::server) agent: u32,
}

/// When the request arrived, and the span it is served in.
pub(in crate::server) struct Timing {
    /// When the request arrived.
    pub(super) started: Instant,
    /// Same, as Unix ms.
    pub(super) started_ms: i64,
    /// The request's span: token figures are recorded on it at the end,
    /// also for streams, whose last bytes are sent outside it.
    pub(super) span: tracing::Span,
}

impl Timing {
    /// A request that arrived at `started` (`started_ms` in Unix ms),
    /// served in `span`.
    pub(in crate::server) fn new(started: Instant, started_ms: i64, span: tracing::Span) -> Self {
        Self {
            started,
            started_ms,
            span,
        }
    }
}

/// Tokens the recall rounds of one request cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct RecallSpent {
    /// Rounds the proxy answered (or ended, sending again without the tool).
    pub(super) rounds: u32,
    /// Their input tokens, as reported.
    pub(super) input_tokens: u64,
    /// Their output tokens, as reported.
    pub(super) output_tokens: u64,
}

impl RecallSpent {
    /// One more round, whose answer reported `usage`.
    pub(super) fn add(&mut self, usage: Option<Usage>) {
        self.rounds += 1;
        if let Some(u) = usage {
            self.input_tokens += u.input_tokens;
            self.output_tokens += u.output_tokens;
        }
    }
}
