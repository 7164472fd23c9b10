//! The exchange under way, the value every phase after the read passes on:
//! the request as read (moved in whole: [`super::request::ReadRequest`]),
//! and the exchange's own parts ([`parts`]): what its items hash to, its
//! conversation, what goes upstream (the view, the compaction applied),
//! the proxy's tools it goes with, and when it arrived; what goes upstream
//! is made in [`outgoing`] (the body, an attempt's headers, the hashes of
//! what is sent). All are private:
//! the phases read them through its methods and change them only through
//! the methods named for what they do; the record's making is among them
//! ([`PendingExchange::finish`], committed by [`super::record`]). Not a
//! phase: any phase may use it.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde_json::Value;

use super::request::ReadRequest;
use crate::app::AppState;
use crate::compaction::{agent_tool, items, recall, Compaction};
use crate::config::{Mode, ModelLimits};
use crate::conversation::Identified;
use crate::engine::{self, Input};
use crate::error::ProxyError;
use crate::store::{
    bounded_text, ExchangeRecord, ExchangeSavings, LeftOut, RecordedWindow, MAX_PREVIEW_CHARS,
};
use crate::wire::items::{ItemList, Tools};
use crate::wire::{chain_extend, item_hash, ItemHash, Usage};

mod outgoing;
mod parts;
mod preview;
mod unanswered;
mod view;

use parts::{Conversation, Offered, RecallSpent, Upstream};
pub(super) use parts::{Digest, Rounds, Timing};
use preview::{is_answer, own_text};
pub(super) use unanswered::Unanswered;

/// Items looked through for a conversation's first user message.
const PREVIEW_SCAN: usize = 32;

/// An exchange between request and completion: the request as read,
/// and the exchange's own parts, each private; the phases read them through
/// the methods below and change them through the methods named for what
/// they do ([`PendingExchange::apply`], [`PendingExchange::withdraw_recall`], ...).
pub struct PendingExchange {
    /// The request as read, whole.
    request: ReadRequest,
    /// What its items and parameters hash to.
    digest: Digest,
    /// The conversation it belongs to.
    conversation: Conversation,
    /// What goes upstream.
    upstream: Upstream,
    /// The proxy's own tools it goes with.
    offered: Offered,
    /// When it arrived.
    timing: Timing,
    /// The record phase, as the driver handed it.
    recorder: Recorder,
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

/// Most characters of an upstream error body kept in a record.
const MAX_ERROR_CHARS: usize = 4096;

/// What a record keeps of an error: redacted of the client's credentials
/// (`auth`) and the proxy's own, and cut short.
fn error_text(state: &AppState, error: &str, auth: &http::HeaderMap) -> String {
    let mut s = state.upstream.redact(error, auth).into_owned();
    if s.len() > MAX_ERROR_CHARS {
        s.truncate(items::floor_boundary(&s, MAX_ERROR_CHARS));
        s.push('…');
    }
    s
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

impl Outcome {
    /// The outcome of a streamed answer the tee read (`partial` and `error`
    /// as the stream ended): one longer than what the tee collects is
    /// recorded as cut, with what it collected.
    pub(in crate::server) fn streamed(
        status: u16,
        tee: &crate::wire::sse::SseTee,
        partial: bool,
        error: Option<String>,
        ttfb_ms: f64,
    ) -> Outcome {
        let cut = tee.cut();
        if !tee.calls_removed().is_empty() {
            tracing::info!(
                tool = %tee.calls_removed().join(", "),
                "the proxy's tools called in a stream relayed as it came: the calls taken out of it"
            );
        }
        Outcome {
            status,
            usage: tee.usage(),
            response_items: tee.items(),
            response_id: tee.response_id(),
            partial: partial || cut.is_some(),
            error: error.or_else(|| tee.error().map(|e| e.to_string())).or(cut),
            ttfb_ms: Some(ttfb_ms),
        }
    }
}

/// Whether the estimate after an exchange with reported `usage` is read by
/// anything: the calibration of reported against estimated tokens, which
/// the fit check and the compaction's budget use once a conversation nears
/// its trigger (from half of it), and the token counts the next request's
/// fit check takes when its bytes (`bytes` this time) no longer clear the
/// hard limit by themselves. A conversation far from both needs none; its
/// items are counted once it gets there.
fn needs_estimate(limits: &ModelLimits, usage: Usage, bytes: u64) -> bool {
    let half_trigger = crate::compaction::policy::trigger_tokens(limits) / 2;
    usage.total() >= half_trigger || bytes >= crate::compaction::policy::hard_limit(limits) / 2
}

/// The stored form of a request's parameters: its body with the tools put
/// back (everything but the items).
fn params_json(body: &Value, tools: Option<&Tools>) -> String {
    let mut params = body.clone();
    Tools::restore(tools, &mut params);
    params.to_string()
}

impl PendingExchange {
    /// Opens exchange `id` of conversation `ident` for `request`, hashed
    /// as `digest`: its items go as they came, with none of the proxy's
    /// tools, which may answer up to `recall_rounds` recall rounds.
    pub(super) fn open(
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
        // As of before the claims of recent requests were looked up: a
        // forget since sends what they and the claims here found stored.
        let claimed_at = self.digest.forgets;
        // A store other processes write keeps the bodies the record leaves
        // out until it commits: a deletion elsewhere may take them first.
        let shared = state.store.is_shared();
        // The items of the prefix an earlier exchange stands for were
        // claimed when that exchange was recorded, and so were those a
        // recorded recent request had too.
        let len = self.digest.hashes.len();
        let suffix_from = self
            .conversation
            .ident
            .prefix
            .map(|p| p.len)
            .unwrap_or(0)
            .min(len);
        let known = self.digest.claims.known();
        let before = suffix_from..known.start.clamp(suffix_from, len);
        let after = known.end.clamp(suffix_from, len)..len;
        let list = self.request.items();
        let body = |at: usize| (self.digest.hashes[at], list.json(at));
        // Which of the items were claimed now (kept track of when shared).
        let mut fresh = vec![false; if shared { len } else { 0 }];
        for range in [before, after] {
            for j in state.store.claim_items(&self.digest.hashes[range.clone()]) {
                if let Some(f) = fresh.get_mut(range.start + j) {
                    *f = true;
                }
                new_items.push(body(range.start + j));
            }
        }
        self.digest.claims.all_claimed();
        // The body holds everything but the items: model, tools, sampling.
        let params_hash = self.digest.params;
        let params_fresh = state.store.claim_item(&params_hash);
        if params_fresh {
            new_items.push((
                params_hash,
                params_json(self.request.body(), self.request.tools()),
            ));
        }
        let response_hashes: Vec<ItemHash> = outcome.response_items.iter().map(item_hash).collect();
        let mut responses_left_out = Vec::new();
        for (h, item) in response_hashes.iter().zip(&outcome.response_items) {
            if state.store.claim_item(h) {
                new_items.push((*h, item.to_string()));
            } else if shared {
                responses_left_out.push((*h, item.clone()));
            }
        }
        // What a shared store's record leaves out, made only if sent.
        let stored_items = if shared {
            let list = list.clone();
            let left_out: Vec<(usize, ItemHash)> = (suffix_from..len)
                .filter(|&at| !fresh[at])
                .map(|at| (at, self.digest.hashes[at]))
                .collect();
            let params = (!params_fresh)
                .then(|| (self.request.body().clone(), self.request.tools().cloned()));
            // It keeps the request's items alive until the commit.
            LeftOut::new(self.request.raw_len(), move || {
                let mut bodies: Vec<(ItemHash, String)> =
                    left_out.iter().map(|&(at, h)| (h, list.json(at))).collect();
                if let Some((body, tools)) = &params {
                    bodies.push((params_hash, params_json(body, tools.as_ref())));
                }
                bodies.extend(responses_left_out.iter().map(|(h, v)| (*h, v.to_string())));
                bodies
            })
        } else {
            LeftOut::default()
        };
        let complete = !outcome.partial && (200..300).contains(&outcome.status);
        ExchangeRecord {
            id: self.conversation.id,
            conversation: self.conversation().to_string(),
            new_conversation: self.conversation.ident.is_new,
            chained_by_id: self.request.previous().is_some(),
            branched_from: self.conversation.ident.branched_from.clone(),
            explicit_key: self.request.explicit_key().map(String::from),
            tenant: self.request.tenant().to_string(),
            api: self.request.api(),
            model: self.request.model().to_string(),
            prefix: self.conversation.ident.prefix,
            suffix_items: self.digest.hashes[suffix_from.min(self.digest.hashes.len())..].to_vec(),
            request_len: self.digest.hashes.len(),
            params: params_hash,
            response_items: response_hashes.clone(),
            new_items,
            stored_items,
            claimed_at,
            journaled: false,
            response_id: outcome.response_id,
            usage: outcome.usage,
            status: outcome.status,
            streamed: self.request.streamed(),
            partial: outcome.partial,
            error: outcome
                .error
                .map(|e| error_text(state, &e, self.request.auth())),
            started_ms: self.timing.started_ms,
            latency_ms: self.timing.started.elapsed().as_secs_f64() * 1000.0,
            ttfb_ms: outcome.ttfb_ms,
            chain_request: (!self.digest.hashes.is_empty()).then_some(self.digest.chain_request),
            // Only a complete answer can be continued by the next request.
            chain_full: (complete && !response_hashes.is_empty())
                .then(|| chain_extend(self.digest.chain_request, &response_hashes)),
            chain_echoed: complete
                .then(|| self.chain_echoed(&outcome.response_items, &response_hashes))
                .flatten(),
            compaction: self.upstream.compaction.as_ref().map(|c| c.id.clone()),
            window: {
                let (limits, source) = state.model_window(self.request.model());
                Some(RecordedWindow {
                    tokens: limits.context_window,
                    source,
                })
            },
            client_ids: self.request.client_ids().clone(),
            client: self.request.user_agent().map(String::from),
            preview: self
                .conversation
                .ident
                .is_new
                .then(|| self.preview(state))
                .flatten(),
            savings: self.savings(state),
        }
    }

    /// The chain over the request and the answer as its client sends it
    /// back, when that differs from the answer ([`Api::echoed`]).
    ///
    /// [`Api::echoed`]: crate::wire::Api::echoed
    fn chain_echoed(&self, items: &[Value], hashes: &[ItemHash]) -> Option<ItemHash> {
        let api = self.request.api();
        let echoed: Vec<Option<Value>> = items.iter().map(|i| api.echoed(i)).collect();
        if echoed.iter().all(Option::is_none) {
            return None;
        }
        let hashes: Vec<ItemHash> = echoed
            .iter()
            .zip(hashes)
            .map(|(e, h)| e.as_ref().map_or(*h, item_hash))
            .collect();
        Some(chain_extend(self.digest.chain_request, &hashes))
    }

    /// What the compaction applied saved, or the would-be one would have,
    /// in the upstream's tokens (the estimate scaled by what it reported
    /// for this conversation).
    fn savings(&self, state: &AppState) -> ExchangeSavings {
        let calibration = state
            .compactions
            .calibration(self.request.tenant(), self.conversation());
        let upstream = |c: &Arc<Compaction>| (c.saved() as f64 * calibration) as u64;
        ExchangeSavings {
            mode: self.request.mode(),
            tokens_saved: self.upstream.compaction.as_ref().map(upstream).unwrap_or(0),
            tokens_saved_potential: self.upstream.observed.as_ref().map(upstream).unwrap_or(0),
            observed_compaction: self.upstream.observed.as_ref().map(|c| c.id.clone()),
            recall_rounds: self.offered.spent.rounds,
            recall_input_tokens: self.offered.spent.input_tokens,
            recall_output_tokens: self.offered.spent.output_tokens,
        }
    }

    /// The person's first message, redacted and cut short, to tell the
    /// conversation it opens from others. Context a client wraps in tags
    /// (Codex's `<environment_context>…`, Claude Code's
    /// `<system-reminder>…` blocks before or after the person's words) is
    /// not theirs; nor are the turns a client writes before the first
    /// request of a conversation reaches any model (aider's few-shot
    /// examples): when the request already holds answers, the person's
    /// message is the one after the last of them.
    fn preview(&self, state: &AppState) -> Option<String> {
        let items = self.request.items();
        let n = items.len();
        let shown = |text: &str| {
            // Cut before redacting (a pasted file may be long), and again
            // after: a credential cut in two at the first cut is gone by
            // the second.
            let cut = bounded_text(text, 4 * MAX_PREVIEW_CHARS);
            bounded_text(
                &state.upstream.redact(&cut, self.request.auth()),
                MAX_PREVIEW_CHARS,
            )
        };
        // The user messages after the last answer, looked for in the tail.
        let mut after_answers = Vec::new();
        for i in (n.saturating_sub(PREVIEW_SCAN)..n).rev() {
            let item = items.item(i);
            if is_answer(&item) {
                after_answers.reverse();
                let own = after_answers.iter().find_map(|t: &String| own_text(t));
                if let Some(own) = own {
                    return Some(shown(own));
                }
                break;
            }
            if items::is_user_message(&item) {
                after_answers.push(items::text_of(&item));
            }
        }
        let mut first: Option<String> = None;
        for i in 0..n.min(PREVIEW_SCAN) {
            let item = items.item(i);
            if !items::is_user_message(&item) {
                continue;
            }
            let text = items::text_of(&item);
            if let Some(own) = own_text(&text) {
                return Some(shown(own));
            }
            if !text.trim().is_empty() {
                first.get_or_insert_with(|| shown(text.trim()));
            }
        }
        first
    }

    /// Records the exchange through the record phase the driver opened it
    /// with ([`Recorder`]), waiting for the commit. False when the answer
    /// must not reach the client: a store shared by replicas could not
    /// commit it (released, it would be an answer no replica knows of).
    pub async fn finish(&self, state: &Arc<AppState>, outcome: Outcome) -> bool {
        (self.recorder.finish)(state, self, outcome).await
    }

    /// Records without waiting (the client is gone; nothing can wait).
    pub fn finish_detached(&self, state: &Arc<AppState>, outcome: Outcome) {
        (self.recorder.detached)(state, self, outcome)
    }

    /// Whether the proxy decides on the next compaction after this
    /// exchange: not when compaction is off, nor after a client's own
    /// compaction request (which starts none of the proxy's).
    pub(super) fn decides_next(&self) -> bool {
        self.request.mode() != Mode::Off && !self.conversation.client_compaction
    }

    /// The per-exchange accounting line: reported usage, estimate by
    /// section of what was sent (where something reads it: see
    /// [`needs_estimate`]), fraction of the model's window, whether past
    /// `warn_ratio`. Then the compaction decision for the next request.
    pub(super) fn account(
        &self,
        state: &Arc<AppState>,
        usage: Option<Usage>,
        status: u16,
        complete: bool,
    ) {
        let background = state.background;
        let state = state.clone();
        let (api, tools, view) = (
            self.request.api(),
            self.request.tools().cloned(),
            self.upstream.view.clone(),
        );
        // The request's own hashes and chains, unless a compaction changed
        // what was sent.
        let sent_as_received = Arc::ptr_eq(&self.upstream.view, self.request.items());
        let hashes = self.view_hashes();
        let chains = sent_as_received.then(|| self.digest.chains.clone());
        // Without reported usage the estimate decides (only a complete
        // answer says how large the conversation now is).
        let next = (complete
            && usage.is_none()
            && self.request.mode() != Mode::Off
            && !self.conversation.client_compaction)
            .then(|| self.input(String::new(), false));
        let potential = self
            .upstream
            .observed
            .as_deref()
            .map(Compaction::saved)
            .unwrap_or(0);
        let (conversation, model, id) = (
            self.conversation().to_string(),
            self.request.model().to_string(),
            self.conversation.id,
        );
        let tenant = self.request.tenant().to_string();
        let compaction = self.upstream.compaction.as_ref().map(|c| c.id.clone());
        let bytes = self.request.raw_len() as u64;
        background.spawn(move || {
            let limits = state.model_limits(&model);
            // What the reported usage measured: the items sent, by their
            // chain, and the tools (the hard-limit check adds to it).
            let sent = usage.filter(|_| complete).map(|u| {
                let chain = match (&chains, &hashes) {
                    (Some(c), _) if c.len() == view.len() => c.last().copied().unwrap_or([0; 32]),
                    (_, Some(h)) if h.len() == view.len() => chain_extend([0; 32], h),
                    _ => chain_extend([0; 32], &view.hashes()),
                };
                engine::Reported {
                    chain,
                    tools: tools.as_ref().map(|t| t.hash),
                    input_tokens: u.input_tokens,
                }
            });
            if let Some(sent) = sent {
                state.compactions.report(&tenant, &conversation, sent);
            }
            let est = usage
                .is_none_or(|u| needs_estimate(&limits, u, bytes))
                .then(|| {
                    let hashes = hashes.unwrap_or_else(|| Arc::new(view.hashes()));
                    // The provider reads from its newest compaction item on,
                    // and so does its reported usage: the estimate counts the
                    // same.
                    let (view, hashes, chains) = match crate::compaction::boundary::newest_in(&view)
                    {
                        Some(b) if b > 0 && hashes.len() == view.len() => (
                            Arc::new(view.with_prefix_replaced(b, &[])),
                            Arc::new(hashes[b..].to_vec()),
                            None,
                        ),
                        _ => (view, hashes, chains),
                    };
                    state.tokens.estimate_chained(
                        api,
                        &view,
                        &hashes,
                        chains.as_deref().map(Vec::as_slice),
                        tools.as_ref(),
                    )
                });
            let (used, source) = match (usage, &est) {
                (Some(u), _) => (u.total(), "reported"),
                (None, est) => (est.as_ref().map_or(0, |e| e.total()), "estimate"),
            };
            if let (Some(u), Some(est)) = (usage, &est) {
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
                est_system = est.as_ref().map(|e| e.system),
                est_messages = est.as_ref().map(|e| e.messages),
                est_tool_outputs = est.as_ref().map(|e| e.tool_outputs),
                est_tool_definitions = est.as_ref().map(|e| e.tool_definitions),
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
    pub(super) fn record_on_span(&self, rec: &ExchangeRecord) {
        if let Some(u) = rec.usage {
            self.timing.span.record("input_tokens", u.input_tokens);
            self.timing.span.record("output_tokens", u.output_tokens);
        }
        if let Some(c) = &rec.compaction {
            self.timing.span.record("compaction", c.as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::own_text;

    #[test]
    fn own_text_drops_the_tagged_context_around_the_persons_words() {
        assert_eq!(
            own_text("<environment_context>\n<cwd>/w</cwd>\n</environment_context>"),
            None
        );
        assert_eq!(
            own_text("<system-reminder>\nctx\n</system-reminder>\nFix it\n<system-reminder a=\"1\">x</system-reminder>"),
            Some("Fix it")
        );
        assert_eq!(own_text("  plain words "), Some("plain words"));
        assert_eq!(own_text("<b>bold</b> words"), Some("words"));
        assert_eq!(own_text("a < b and c > d"), Some("a < b and c > d"));
        assert_eq!(own_text("<unclosed> words"), Some("<unclosed> words"));
        assert_eq!(own_text("   "), None);
    }
}
