//! What a compaction starts from: the request as it would go upstream,
//! what is asked of the result, and what the upstream last saw.

use std::sync::Arc;

use http::HeaderMap;
use serde_json::Value;

use crate::compaction::policy::Stated;
use crate::compaction::Compaction;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{Api, ItemHash};

/// What a compaction starts from, grouped by subject: whose conversation
/// it is, the request as it would go upstream, what is asked of the
/// compaction, and how the conversation is served.
#[derive(Clone)]
pub struct Input {
    /// Whose conversation it is, and how its upstream is called.
    pub who: Who,
    /// The request as it would go upstream.
    pub request: Request,
    /// What is asked of the compaction.
    pub ask: Ask,
    /// How the conversation is served.
    pub serving: Serving,
}

/// Whose conversation a compaction is of, and how its upstream is called.
#[derive(Clone)]
pub struct Who {
    /// The conversation's wire format (the summary call uses it too).
    pub api: Api,
    /// Tenant.
    pub tenant: String,
    /// Conversation.
    pub conversation: String,
    /// The conversation's model.
    pub model: String,
    /// The client's credential headers, for the summarizer call (memory only).
    pub auth: HeaderMap,
}

/// The request a compaction starts from, as it would go upstream.
#[derive(Clone)]
pub struct Request {
    /// The request's items after any compaction already applied.
    pub view: Arc<ItemList>,
    /// Chain hashes of the original (client-sent) items.
    pub chains: Arc<Vec<ItemHash>>,
    /// The compaction already applied, if any.
    pub base: Option<Arc<Compaction>>,
    /// The request's tool definitions (they count against the window).
    pub tools: Option<Tools>,
    /// The request's top-level `system` (Anthropic Messages), which the
    /// provider's compaction call sends as the conversation does.
    pub system: Option<Value>,
    /// The request as the upstream last saw it, for a summary call that
    /// reads its history from the upstream's prompt cache.
    pub sent: Option<Arc<Sent>>,
    /// When the request arrived, on the process's monotonic clock (a
    /// wall clock set back would make a compaction stored before it look
    /// stored after it: see `engine::jobs`).
    pub requested: std::time::Instant,
}

/// What is asked of a compaction.
#[derive(Clone)]
pub struct Ask {
    /// Why.
    pub reason: String,
    /// What the result must achieve.
    pub goal: Goal,
    /// Compact the whole history, keeping no verbatim tail (explicit
    /// compaction requests: `/v1/responses/compact`, `compaction_trigger`).
    pub whole: bool,
    /// The model's own notes of what to keep (its `compactor_compact`
    /// call): the compaction is a summary, and they are a section of it.
    pub keep: Option<String>,
    /// The result is a background compaction (threshold, agent), counted at
    /// its first application: a threshold one's on the next request that
    /// extends it, the model's at the conversation's next turn boundary
    /// unless a request over the hard limit needs it sooner.
    pub soft: bool,
}

/// How the conversation a compaction is of is served.
#[derive(Clone, Copy)]
pub struct Serving {
    /// Observe mode: the result is recorded as what the proxy would have
    /// done, never applied. [`Request::view`] is then the client's items
    /// and [`Request::base`] the would-be compaction before, which is
    /// applied here first.
    pub observe: bool,
    /// The request asks the provider to compact
    /// ([`crate::compaction::boundary::asks_provider_compaction`]): the
    /// threshold trigger leaves the conversation to it.
    pub provider_compaction: bool,
    /// The threshold starts no compaction after this exchange: one already
    /// waits for the turn boundary, or the mode is manual.
    pub no_trigger: bool,
}

/// What the upstream last saw of a conversation's request, but its items
/// (the [`Request::view`]): a summary call that repeats it, with one user
/// message appended, reads everything before that message from the
/// upstream's prompt cache (see `engine::summarizer`).
#[derive(Debug, Clone)]
pub struct Sent {
    /// The body without its items: the model, `system`, `tool_choice`,
    /// thinking, sampling parameters, and `tools` as sent (the proxy's
    /// own among them).
    pub body: Value,
    /// The request's provider headers that decide what its body means
    /// (`anthropic-version`, `anthropic-beta`); the credentials are
    /// [`Who::auth`].
    pub headers: HeaderMap,
}

/// What a compaction must achieve; it escalates past the ladder until it
/// does, or declines before any summarizer call when nothing could.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Goal {
    /// Shrink the request by [`FIT_MARGIN`](crate::compaction::policy::FIT_MARGIN) at least (background, manual).
    #[default]
    Shrink,
    /// Fit the model's hard limit, window less max output (the pre-send
    /// check, explicit compaction requests).
    HardLimit,
    /// The upstream refused the request as too long.
    Overflow {
        /// What its answer stated.
        stated: Stated,
        /// The request's own max output, if it set one.
        max_output: Option<u64>,
    },
}

/// The label of a goal in logs and metrics.
pub(super) fn goal_kind(goal: Goal) -> &'static str {
    match goal {
        Goal::Shrink => "shrink",
        Goal::HardLimit => "hard_limit",
        Goal::Overflow { .. } => "overflow",
    }
}
