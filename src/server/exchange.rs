//! The exchange under way, the value every phase after the read passes on:
//! the request's body (its parameters, items and tools, and the client's
//! bytes while they can go as they came), the items that go upstream, and
//! what is known of the conversation; with every method of it, the
//! record's making among them ([`PendingExchange::finish`], committed by
//! [`super::record`]). Not a phase: any phase may use it.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::record;
use crate::app::AppState;
use crate::compaction::{agent_tool, items, recall, Compaction};
use crate::config::Mode;
use crate::conversation::Identified;
use crate::engine::{self, Input};
use crate::error::ProxyError;
use crate::store::{
    bounded_text, ExchangeRecord, ExchangeSavings, RecordedWindow, MAX_PREVIEW_CHARS,
};
use crate::upstream::Payload;
use crate::wire::items::{Claims, ItemList, Tools};
use crate::wire::{chain_extend, item_hash, messages, Api, ItemHash, Usage};

/// Items looked through for a conversation's first user message.
const PREVIEW_SCAN: usize = 32;

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
    /// need not be rebuilt (see [`super::request::ReadRequest::original`]).
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
        if let Some(spliced) = self.spliced_bytes() {
            return Ok(spliced);
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

    /// The compacted request as the client's bytes with the compaction's
    /// JSON in place of the items it covers, nothing parsed or serialised:
    /// where the view is exactly its replacement followed by the client's
    /// items past it, and nothing else changes (no tool the proxy adds, no
    /// recall rounds, no thinking block to drop). Else `None`: the body is
    /// rebuilt.
    fn spliced_bytes(&self) -> Option<Payload> {
        let c = self.plain_compaction()?;
        if self.drop_block || self.recall || self.agent_tool || !self.extra.is_empty() {
            return None;
        }
        let (cut, follow) = self.items.covered_span(c.covered_len)?;
        self.original.as_ref()?.with_cut_replaced(
            self.items.body_bytes(),
            cut,
            c.replacement_json(self.api, follow),
        )
    }

    /// The compaction applied, when the view is its replacement followed
    /// by the client's items past it, unchanged: in every API but
    /// Anthropic Messages, whose view [`PendingExchange::apply`] edits.
    fn plain_compaction(&self) -> Option<&Compaction> {
        self.compaction
            .as_deref()
            .filter(|_| self.api != Api::Messages)
    }

    /// The hashes of the view's items when they are known without hashing
    /// anything: the request's own, or those of a plain compaction's
    /// replacement (made once per compaction) followed by the request's
    /// past what it covers.
    pub fn view_hashes(&self) -> Option<Arc<Vec<ItemHash>>> {
        if Arc::ptr_eq(&self.view, &self.items) {
            return Some(self.hashes.clone());
        }
        let c = self.plain_compaction()?;
        let tail = self.hashes.get(c.covered_len..)?;
        let mut all = Vec::with_capacity(c.replacement.len() + tail.len());
        all.extend_from_slice(c.replacement_hashes());
        all.extend_from_slice(tail);
        Some(Arc::new(all))
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

/// The record: made when the exchange ends, committed by [`super::record`].
impl PendingExchange {
    /// Records an exchange that failed before an answer could be relayed
    /// and returns the error for the client.
    pub async fn fail(
        self,
        state: &Arc<AppState>,
        err: ProxyError,
        ttfb_ms: Option<f64>,
    ) -> ProxyError {
        let outcome = Outcome {
            status: err.status().as_u16(),
            error: Some(err.to_string()),
            ttfb_ms,
            ..Outcome::default()
        };
        self.finish(state, outcome).await;
        err
    }

    /// Builds the record: claims item bodies not yet stored, computes chains.
    pub fn to_record(&self, state: &AppState, outcome: Outcome) -> ExchangeRecord {
        let mut new_items = Vec::new();
        // The items of the prefix an earlier exchange stands for were
        // claimed when that exchange was recorded, and so were those a
        // recorded recent request had too.
        let len = self.hashes.len();
        let suffix_from = self.ident.prefix.map(|p| p.len).unwrap_or(0).min(len);
        let known = self.claims.known();
        let before = suffix_from..known.start.clamp(suffix_from, len);
        let after = known.end.clamp(suffix_from, len)..len;
        for range in [before, after] {
            for j in state.store.claim_items(&self.hashes[range.clone()]) {
                let at = range.start + j;
                new_items.push((self.hashes[at], self.items.json(at)));
            }
        }
        self.claims.all_claimed();
        // The body holds everything but the items: model, tools, sampling.
        let params_hash = self.params;
        if state.store.claim_item(&params_hash) {
            let mut params = (*self.body).clone();
            Tools::restore(self.tools.as_ref(), &mut params);
            new_items.push((params_hash, params.to_string()));
        }
        let response_hashes: Vec<ItemHash> = outcome.response_items.iter().map(item_hash).collect();
        for (h, item) in response_hashes.iter().zip(&outcome.response_items) {
            if state.store.claim_item(h) {
                new_items.push((*h, item.to_string()));
            }
        }
        let complete = !outcome.partial && (200..300).contains(&outcome.status);
        ExchangeRecord {
            id: self.id,
            conversation: self.ident.conversation.clone(),
            new_conversation: self.ident.is_new,
            explicit_key: self.explicit_key.clone(),
            tenant: self.tenant.clone(),
            api: self.api,
            model: self.model.clone(),
            prefix: self.ident.prefix,
            suffix_items: self.hashes[suffix_from.min(self.hashes.len())..].to_vec(),
            request_len: self.hashes.len(),
            params: params_hash,
            response_items: response_hashes.clone(),
            new_items,
            response_id: outcome.response_id,
            usage: outcome.usage,
            status: outcome.status,
            streamed: self.streamed,
            partial: outcome.partial,
            error: outcome
                .error
                .map(|e| record::error_text(state, &e, &self.auth)),
            started_ms: self.started_ms,
            latency_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            ttfb_ms: outcome.ttfb_ms,
            chain_request: (!self.hashes.is_empty()).then_some(self.chain_request),
            // Only a complete answer can be continued by the next request.
            chain_full: (complete && !response_hashes.is_empty())
                .then(|| chain_extend(self.chain_request, &response_hashes)),
            compaction: self.compaction.as_ref().map(|c| c.id.clone()),
            window: {
                let (limits, source) = state.model_window(&self.model);
                Some(RecordedWindow {
                    tokens: limits.context_window,
                    source,
                })
            },
            client_ids: self.client_ids.clone(),
            client: self.client.clone(),
            preview: self.ident.is_new.then(|| self.preview(state)).flatten(),
            savings: self.savings(state),
        }
    }

    /// What the compaction applied saved, or the would-be one would have,
    /// in the upstream's tokens (the estimate scaled by what it reported
    /// for this conversation).
    fn savings(&self, state: &AppState) -> ExchangeSavings {
        let calibration = state
            .compactions
            .calibration(&self.tenant, &self.ident.conversation);
        let upstream = |c: &Arc<Compaction>| (c.saved() as f64 * calibration) as u64;
        ExchangeSavings {
            mode: self.mode,
            tokens_saved: self.compaction.as_ref().map(upstream).unwrap_or(0),
            tokens_saved_potential: self.observed.as_ref().map(upstream).unwrap_or(0),
            observed_compaction: self.observed.as_ref().map(|c| c.id.clone()),
            recall_rounds: self.recall_spent.rounds,
            recall_input_tokens: self.recall_spent.input_tokens,
            recall_output_tokens: self.recall_spent.output_tokens,
        }
    }

    /// Its first user message, redacted and cut short, to tell the
    /// conversation it opens from others. Codex opens with context blocks
    /// sent as user messages (`<environment_context>…`): a message of the
    /// person's own after them is the one shown.
    fn preview(&self, state: &AppState) -> Option<String> {
        let mut first: Option<String> = None;
        for i in 0..self.items.len().min(PREVIEW_SCAN) {
            let item = self.items.item(i);
            if !items::is_user_message(&item) {
                continue;
            }
            let text = items::text_of(&item);
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            // Cut before redacting (a pasted file may be long), and again
            // after: a credential cut in two at the first cut is gone by
            // the second.
            let cut = bounded_text(text, 4 * MAX_PREVIEW_CHARS);
            let shown = bounded_text(&state.upstream.redact(&cut, &self.auth), MAX_PREVIEW_CHARS);
            if !(text.starts_with('<') && text.ends_with('>')) {
                return Some(shown);
            }
            first.get_or_insert(shown);
        }
        first
    }

    /// Records the exchange (waiting for the commit), indexes it, and logs
    /// the accounting line in the background. False when the answer must
    /// not reach the client: a store shared by replicas could not commit it
    /// (released, it would be an answer no replica knows of).
    pub async fn finish(&self, state: &Arc<AppState>, outcome: Outcome) -> bool {
        // The provider compacted in this answer (a client that asked it to).
        if outcome
            .response_items
            .iter()
            .any(crate::compaction::boundary::is_provider_item)
        {
            state.metrics.provider_compaction();
        }
        let rec = self.to_record(state, outcome);
        self.record_on_span(&rec);
        let usage = rec.usage;
        let potential = rec.savings.tokens_saved_potential;
        let status = rec.status;
        let complete = !rec.partial && (200..300).contains(&rec.status);
        let recorded = record::commit(state, rec).await;
        // With reported usage the decision needs no tokenizer: take it now,
        // before the answer's last bytes are released, so a client that
        // sends its next request at once finds the compaction under way.
        // In observe mode the decision is taken on the size the request
        // would have had, as it would be in auto mode.
        // A client's own compaction request starts none of the proxy's.
        let decides = self.mode != Mode::Off && !self.client_compaction;
        if let (true, Some(u), true) = (complete, usage, decides) {
            let used = u.total().saturating_sub(potential);
            engine::after_exchange(state, self.input(String::new(), false), used, false);
        }
        self.account(state, usage, status, complete);
        recorded || !state.store.is_shared()
    }

    /// Records without waiting (the client is gone; nothing can wait).
    pub fn finish_detached(&self, state: &Arc<AppState>, outcome: Outcome) {
        let rec = self.to_record(state, outcome);
        record::commit_detached(state, rec);
    }

    /// The per-exchange accounting line: reported usage, estimate by
    /// section of what was sent, fraction of the model's window, whether
    /// past `warn_ratio`. Then the compaction decision for the next request.
    fn account(&self, state: &Arc<AppState>, usage: Option<Usage>, status: u16, complete: bool) {
        let background = state.background;
        let state = state.clone();
        let (api, tools, view) = (self.api, self.tools.clone(), self.view.clone());
        // The request's own hashes and chains, unless a compaction changed
        // what was sent.
        let sent_as_received = Arc::ptr_eq(&self.view, &self.items);
        let hashes = self.view_hashes();
        let chains = sent_as_received.then(|| self.chains.clone());
        // Without reported usage the estimate decides (only a complete
        // answer says how large the conversation now is).
        let next =
            (complete && usage.is_none() && self.mode != Mode::Off && !self.client_compaction)
                .then(|| self.input(String::new(), false));
        let potential = self.observed.as_deref().map(Compaction::saved).unwrap_or(0);
        let (conversation, model, id) =
            (self.ident.conversation.clone(), self.model.clone(), self.id);
        let tenant = self.tenant.clone();
        let compaction = self.compaction.as_ref().map(|c| c.id.clone());
        background.spawn(move || {
            let hashes = hashes.unwrap_or_else(|| Arc::new(view.hashes()));
            // The provider reads from its newest compaction item on, and so
            // does its reported usage: the estimate counts the same.
            let (view, hashes, chains) = match crate::compaction::boundary::newest_in(&view) {
                Some(b) if b > 0 && hashes.len() == view.len() => (
                    Arc::new(view.with_prefix_replaced(b, &[])),
                    Arc::new(hashes[b..].to_vec()),
                    None,
                ),
                _ => (view, hashes, chains),
            };
            let est = state.tokens.estimate_chained(
                api,
                &view,
                &hashes,
                chains.as_deref().map(Vec::as_slice),
                tools.as_ref(),
            );
            let limits = state.model_limits(&model);
            let (used, source) = match usage {
                Some(u) => (u.total(), "reported"),
                None => (est.total(), "estimate"),
            };
            if let Some(u) = usage {
                state
                    .compactions
                    .calibrate(&tenant, &conversation, u.input_tokens, est.total());
            }
            let fraction = used as f64 / limits.context_window as f64;
            // Past `warn_ratio` is ordinary for a long conversation (the
            // trigger is beyond it): the line says so at info, a field to
            // filter on, not a warning on an operator's screen.
            let past_warn_ratio = fraction >= state.config.compaction.warn_ratio;
            tracing::info!(
                conversation = %conversation, exchange = id, model = %model, status,
                compaction = compaction.as_deref().unwrap_or(""),
                input_tokens = usage.map(|u| u.input_tokens),
                output_tokens = usage.map(|u| u.output_tokens),
                tokens = used, tokens_source = source,
                est_system = est.system, est_messages = est.messages,
                est_tool_outputs = est.tool_outputs, est_tool_definitions = est.tool_definitions,
                window = limits.context_window, fraction = format!("{fraction:.3}"),
                past_warn_ratio,
                "exchange"
            );
            if let Some(input) = next {
                engine::after_exchange(&state, input, used.saturating_sub(potential), true);
            }
        });
    }

    /// The record's token figures and compaction, on the request's span.
    fn record_on_span(&self, rec: &ExchangeRecord) {
        if let Some(u) = rec.usage {
            self.span.record("input_tokens", u.input_tokens);
            self.span.record("output_tokens", u.output_tokens);
        }
        if let Some(c) = &rec.compaction {
            self.span.record("compaction", c.as_str());
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
