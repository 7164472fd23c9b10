//! The exchange under way, the value every phase after the read passes on:
//! the request's body (its parameters, items and tools, and the client's
//! bytes while they can go as they came), the items that go upstream, and
//! what is known of the conversation. Its record is made in [`super::record`].

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::app::AppState;
use crate::compaction::{agent_tool, recall, Compaction};
use crate::config::Mode;
use crate::conversation::Identified;
use crate::engine::{self, Input};
use crate::error::ProxyError;
use crate::upstream::Payload;
use crate::wire::items::{Claims, ItemList, Tools};
use crate::wire::{messages, Api, ItemHash, Usage};

/// An exchange between request and completion.
pub struct PendingExchange {
    /// Exchange id.
    pub id: i64,
    /// Which conversation.
    pub ident: Identified,
    /// The explicit key the conversation goes by, if any.
    pub explicit_key: Option<String>,
    /// The ids the client sent for its conversation, as sent.
    pub client_ids: crate::store::ClientIds,
    /// The client, from its `user-agent`.
    pub client: Option<String>,
    /// Tenant hash.
    pub tenant: String,
    /// Which API.
    pub api: Api,
    /// Requested model.
    pub model: String,
    /// The client's request body without its items (they are in `items`)
    /// and tools (in `tools`): model, sampling parameters. Stream usage the
    /// proxy asks for is added only to the bytes that go upstream.
    pub body: Arc<Value>,
    /// Hash of `body` with its tools (the request's parameters).
    pub params: ItemHash,
    /// The tool definitions, if any (`body` holds `null` in their place).
    pub tools: Option<Tools>,
    /// Its items (the client's bytes until something must look inside).
    pub items: Arc<ItemList>,
    /// Their hashes.
    pub hashes: Arc<Vec<ItemHash>>,
    /// Chain hash over all request items (zeros if none).
    pub chain_request: ItemHash,
    /// Chain hash of each prefix of the request items.
    pub chains: Arc<Vec<ItemHash>>,
    /// Which of `hashes` the store has claimed already.
    pub claims: Claims,
    /// The bytes that go upstream while no compaction applies, when they
    /// need not be rebuilt (see [`super::read::ReadRequest::original`]).
    pub original: Option<Payload>,
    /// The proxy asked for stream usage the client did not ask for.
    pub strip_usage: bool,
    /// The items as sent upstream (after compaction; the same as `items` when none applied).
    pub view: Arc<ItemList>,
    /// The compaction applied, if any.
    pub compaction: Option<Arc<Compaction>>,
    /// The mode the request is served in.
    pub mode: Mode,
    /// Observe mode: the would-be compaction that covers a prefix of the
    /// request (what the proxy would have applied).
    pub observed: Option<Arc<Compaction>>,
    /// Anthropic Messages: the request may hold a thinking block signed
    /// against another prefix than it now has (the compacted request's open
    /// tool loop; the client's own history sent again after a compacted
    /// one was refused), so it asks the API to drop such a block
    /// (`thinking.block_binding`, with its beta).
    pub drop_block: bool,
    /// The request goes with the `compactor_recall` tool added.
    pub recall: bool,
    /// Most recall rounds the proxy answers (`compaction.recall_max_rounds`;
    /// 0: the tool is never offered).
    pub recall_rounds: u32,
    /// The tool was offered at some point: every answer is looked at for
    /// calls of it, also after it is withdrawn, so none reaches a client
    /// that never declared it.
    pub recall_offered: bool,
    /// The tool was withdrawn (past the rounds, beside the client's own
    /// calls, an overflow): a later compaction does not offer it again.
    pub recall_withdrawn: bool,
    /// The client's own compaction request (Codex's `request_kind:
    /// compaction`, Claude Code's summary prompt): it goes as the client
    /// sent it when it fits, else with a stored compaction applied, is
    /// never compacted afresh before the upstream refuses it, and starts
    /// no compaction of its own.
    pub client_compaction: bool,
    /// Items after the view: the recall rounds' calls and answers.
    pub extra: Vec<Value>,
    /// A stored compaction of the conversation waits for its first turn
    /// boundary, and this request (inside a turn) went without it: the
    /// threshold starts no other after it.
    pub deferred: bool,
    /// The request goes with the `compactor_compact` tool added.
    pub agent_tool: bool,
    /// Anthropic Messages with thinking on: an earlier answer of the
    /// conversation came after a round the proxy answered itself (recall,
    /// `compactor_compact`), so its thinking was signed against a prefix
    /// the client's history lacks; every request of the conversation lets
    /// the API drop such a block (see `drop_block`).
    pub hidden_thinking: bool,
    /// The tool was offered at some point: every answer is looked at for
    /// calls of it, also after it is withdrawn.
    pub agent_offered: bool,
    /// What the recall rounds cost.
    pub recall_spent: RecallSpent,
    /// The client's credential headers, kept in memory for summary calls.
    pub auth: http::HeaderMap,
    /// Whether the client asked for a stream.
    pub streamed: bool,
    /// When the request arrived.
    pub started: Instant,
    /// Same, as Unix ms.
    pub started_ms: i64,
    /// The request's span: token figures are recorded on it at the end,
    /// also for streams, whose last bytes are sent outside it.
    pub span: tracing::Span,
}

/// How an exchange ended.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Status the client received.
    pub status: u16,
    /// Reported usage.
    pub usage: Option<Usage>,
    /// Output items.
    pub response_items: Vec<Value>,
    /// Upstream's answer id.
    pub response_id: Option<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// The answer was cut short.
    pub partial: bool,
    /// Time to upstream's response headers, ms.
    pub ttfb_ms: Option<f64>,
}

impl PendingExchange {
    /// Applies a compaction: the view becomes its replacement followed by
    /// the rest of the client's items.
    pub fn apply(&mut self, c: Arc<Compaction>) {
        let view = self
            .items
            .with_prefix_replaced(c.covered_len, &c.replacement);
        self.drop_block = self.hidden_thinking;
        self.view = Arc::new(if self.api == Api::Messages {
            // The tail's old thinking and surplus cache breakpoints (see
            // `wire::messages::finish_view`).
            let outside = self
                .tools
                .as_ref()
                .map_or(0, |t| messages::breakpoints(t.value()))
                + self.body.get("system").map_or(0, messages::breakpoints);
            let mut values = view.into_values();
            self.drop_block |= messages::finish_view(&mut values, c.replacement.len(), outside)
                || crate::compaction::provider::keeps_thinking(&c.replacement);
            values.into()
        } else {
            view
        });
        self.compaction = Some(c);
        self.offer_recall();
    }

    /// Offers `compactor_recall` when the view now carries archived
    /// originals (whatever compacted it: a stored compaction, a hard-limit,
    /// manual or requested one, an overflow's) and the request may have it
    /// (see [`recall::offers_recall`]).
    fn offer_recall(&mut self) {
        let Some(c) = &self.compaction else {
            return;
        };
        if self.recall_withdrawn || self.recall_rounds == 0 {
            return;
        }
        self.recall = recall::carries_archive(&c.replacement)
            && recall::offers_recall(
                &self.body,
                self.tools.as_ref().map(Tools::value),
                &self.view.values(),
            );
        self.recall_offered |= self.recall;
    }

    /// Offers `compactor_compact` when `on` (`compaction.agent_tool` for
    /// the request's tenant and model), the mode lets the proxy rewrite the
    /// request, it is not the client's own compaction request, and the
    /// request may have it (see [`agent_tool::offers`]).
    pub fn offer_agent_tool(&mut self, on: bool) {
        self.agent_tool = on
            && self.mode.rewrites()
            && !self.client_compaction
            && agent_tool::offers(&self.body, self.tools.as_ref().map(Tools::value));
        self.agent_offered |= self.agent_tool;
    }

    /// Takes the recall tool away for the rest of the request; with
    /// `forget`, the rounds' calls and answers too.
    pub fn withdraw_recall(&mut self, forget: bool) {
        self.recall = false;
        self.recall_withdrawn = true;
        if forget {
            self.extra.clear();
        }
    }

    /// Takes `compactor_compact` away for the rest of the request (its
    /// calls are still looked for, and never relayed).
    pub fn withdraw_agent_tool(&mut self) {
        self.agent_tool = false;
    }

    /// The headers of an attempt: `headers`, with the beta a request that
    /// lets the API drop a thinking block needs.
    pub fn upstream_headers<'a>(&self, headers: &'a http::HeaderMap) -> Cow<'a, http::HeaderMap> {
        // A provider's compaction block in the view: every request carrying
        // it needs the beta it was made under.
        let compact_beta = self.api == Api::Messages
            && self
                .compaction
                .as_ref()
                .is_some_and(|c| crate::compaction::provider::carries_block(&c.replacement));
        if !self.drop_block && !compact_beta {
            return Cow::Borrowed(headers);
        }
        let mut out = headers.clone();
        if self.drop_block {
            messages::add_binding_beta(&mut out);
        }
        if compact_beta {
            let beta = crate::compaction::provider::with_beta(
                out.get("anthropic-beta").and_then(|v| v.to_str().ok()),
            );
            if let Ok(v) = http::HeaderValue::from_str(&beta) {
                out.insert("anthropic-beta", v);
            }
        }
        Cow::Owned(out)
    }

    /// Goes back to the client's own items. On Anthropic Messages with
    /// thinking on, the client's history may hold thinking the API signed
    /// against an earlier compacted request, which it would refuse as sent:
    /// the request lets the API drop such blocks.
    pub fn unapply(&mut self) {
        self.view = self.items.clone();
        self.compaction = None;
        self.drop_block = self.api == Api::Messages && messages::thinking_on(&self.body);
        self.recall = false;
        self.extra.clear();
    }

    /// The body to send upstream: the client's bytes while they can go as
    /// they came, else the body rebuilt around the items of the view.
    pub fn upstream_bytes(&self) -> Result<Payload, ProxyError> {
        if let (None, Some(original), false, false) = (
            &self.compaction,
            &self.original,
            self.drop_block,
            self.agent_tool,
        ) {
            return Ok(original.clone());
        }
        let bound;
        let body = if self.drop_block {
            let mut b = (*self.body).clone();
            messages::with_block_binding(&mut b);
            bound = b;
            &bound
        } else {
            &*self.body
        };
        if !self.recall && !self.agent_tool && self.extra.is_empty() {
            return self
                .api
                .rebuild_body(body, &self.view.values(), self.tools.as_ref())
                .map(Payload::from)
                .map_err(ProxyError::internal);
        }
        let mut items = self.view.values().to_vec();
        items.extend(self.extra.iter().cloned());
        let with_recall = (self.recall || self.agent_tool).then(|| {
            let tools = self
                .tools
                .as_ref()
                .map(Tools::value)
                .unwrap_or(&Value::Null);
            let recall = self.recall.then(|| recall::definition(self.api));
            let listed = agent_tool::with_tools(self.api, tools, self.agent_tool, recall);
            let mut body = serde_json::json!({ "tools": listed });
            Tools::take(&mut body)
        });
        let tools = with_recall
            .as_ref()
            .map_or(self.tools.as_ref(), Option::as_ref);
        self.api
            .rebuild_body(body, &items, tools)
            .map(Payload::from)
            .map_err(ProxyError::internal)
    }

    /// What a compaction of this request starts from (in observe mode,
    /// the client's items and the would-be compaction before).
    pub fn input(&self, reason: String, whole: bool) -> Input {
        let observe = self.mode == Mode::Observe;
        Input {
            api: self.api,
            tenant: self.tenant.clone(),
            conversation: self.ident.conversation.clone(),
            model: self.model.clone(),
            view: self.view.clone(),
            chains: self.chains.clone(),
            base: if observe {
                self.observed.clone()
            } else {
                self.compaction.clone()
            },
            auth: self.auth.clone(),
            reason,
            requested_ms: self.started_ms,
            whole,
            goal: engine::Goal::Shrink,
            tools: self.tools.clone(),
            system: (self.api == Api::Messages)
                .then(|| self.body.get("system").cloned())
                .flatten(),
            observe,
            provider_compaction: crate::compaction::boundary::asks_provider_compaction(
                self.api, &self.body,
            ),
            soft: false,
            keep: None,
            no_trigger: self.deferred || self.mode == Mode::Manual,
        }
    }
}

/// An exchange whose answer has not been handed to the client yet. A
/// client that leaves before then (a timeout while the model thinks, say)
/// makes hyper drop the request's future, and this with it: the exchange
/// is recorded with status 499 (as nginx logs a client that closed the
/// request), and the upstream request, dropped with the future, is
/// cancelled. Every path that answers takes the exchange out first.
pub(super) struct Unanswered {
    state: Arc<AppState>,
    /// Always here until [`Unanswered::into_inner`] or the drop.
    pending: Option<PendingExchange>,
}

/// The status recorded for an exchange whose client left before its answer.
pub const CLIENT_CLOSED: u16 = 499;

impl Unanswered {
    pub(super) fn new(state: &Arc<AppState>, pending: PendingExchange) -> Self {
        Self {
            state: state.clone(),
            pending: Some(pending),
        }
    }

    /// The exchange, for the path that answers (and records) it.
    pub(super) fn into_inner(mut self) -> PendingExchange {
        self.pending.take().expect("present until taken")
    }
}

impl std::ops::Deref for Unanswered {
    type Target = PendingExchange;
    fn deref(&self) -> &PendingExchange {
        self.pending.as_ref().expect("present until taken")
    }
}

impl std::ops::DerefMut for Unanswered {
    fn deref_mut(&mut self) -> &mut PendingExchange {
        self.pending.as_mut().expect("present until taken")
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            let outcome = Outcome {
                status: CLIENT_CLOSED,
                error: Some(format!("{} before the answer", self.state.cut_reason())),
                ..Outcome::default()
            };
            p.finish_detached(&self.state, outcome);
        }
    }
}

/// Tokens the recall rounds of one request cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RecallSpent {
    /// Rounds the proxy answered (or ended, sending again without the tool).
    pub rounds: u32,
    /// Their input tokens, as reported.
    pub input_tokens: u64,
    /// Their output tokens, as reported.
    pub output_tokens: u64,
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
