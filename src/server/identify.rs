//! Phase 2, identify and apply compaction: runs once the request is read
//! and parsed, before anything goes upstream. Names the conversation, opens
//! the exchange, applies the stored compaction that covers it, and says
//! whether it needs one made now ([`Compact`], which the driver has
//! `server::compact_now` make). It must not compact, send the request or
//! answer the client.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::exchange::{PendingExchange, Unanswered};
use super::request::ReadRequest;
use crate::app::AppState;
use crate::compaction::Compaction;
use crate::config::Mode;
use crate::engine;
use crate::error::ProxyError;
use crate::store::{bounded_text, MAX_CLIENT_CHARS};
use crate::wire::items::{ItemList, Tools};
use crate::wire::{self, item_hash, messages, Api};

/// The compaction a request identified needs made now, before it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Compact {
    /// None: it goes as it is now.
    No,
    /// Too large to go out as it is (its estimated tokens, over the hard
    /// limit), and nothing under way: compact now rather than let the
    /// upstream refuse it.
    HardLimit(u64),
    /// A compaction that waited for its boundary was applied for the first
    /// time to a request over the hard limit: compacted afresh if it leaves
    /// the request over still.
    IfStillOver,
}

/// Identifies the conversation of a request read, opens its exchange,
/// applies the stored compaction it takes, if any, and says what it needs
/// compacted now. Fails only when the store cannot take the exchange (its
/// database is unreachable): then nothing goes upstream.
pub(super) async fn identify(
    state: &Arc<AppState>,
    parts: &http::request::Parts,
    read: ReadRequest,
    started: Instant,
    started_ms: i64,
) -> Result<(Unanswered, Compact), ProxyError> {
    let ReadRequest {
        api,
        tenant,
        body,
        items,
        tools,
        body_key,
        previous,
        original,
        strip_usage,
        raw_len,
        control,
        ..
    } = read;
    // A stalled database refuses the request now, before it reads the
    // database or anything goes upstream.
    state.store.available().map_err(ProxyError::store_down)?;
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let streamed = body.get("stream").and_then(Value::as_bool) == Some(true);
    let (hashes, chains, claims) = items.hashes_and_chains(&tenant);
    let explicit_key = wire::explicit_conversation_key(&parts.headers, &body);
    // With a store other replicas write, what this replica may lack of the
    // request (a longer recorded prefix, a compaction covering more) is
    // read now, in one round trip, awaited; the match and the compaction
    // lookups below use what it found (see `Compactions::prefetch`).
    let prefetched = state
        .compactions
        .prefetch(&state.conversations, &tenant, &chains)
        .await;
    let ident = state.conversations.identify_with(
        &tenant,
        explicit_key.as_deref(),
        previous.as_deref(),
        &chains,
        prefetched.chain.clone(),
    );
    state
        .compactions
        .matched(&tenant, &ident.conversation, &prefetched);
    let span = tracing::Span::current();
    span.record("conversation", ident.conversation.as_str());
    span.record("model", model.as_str());
    state.metrics.conversation_seen(&ident.conversation);
    // The parameters' hash, through their bytes unless the proxy changed
    // the body (an expanded `previous_response_id`).
    let full_hash = || {
        let mut full = body.clone();
        Tools::restore(tools.as_ref(), &mut full);
        item_hash(&full)
    };
    let params = match body_key {
        Some(key) => state.item_caches.cached_hash(key, full_hash),
        None => full_hash(),
    };
    let items: Arc<ItemList> = Arc::new(items);
    let mut pending = Unanswered::new(
        state,
        PendingExchange {
            id: state
                .store
                .next_exchange_id()
                .map_err(ProxyError::store_down)?,
            ident,
            explicit_key,
            client_ids: wire::client_ids(&parts.headers, &body),
            client: header_text(&parts.headers, http::header::USER_AGENT.as_str())
                .map(|ua| bounded_text(ua, MAX_CLIENT_CHARS)),
            tenant,
            api,
            model,
            body: Arc::new(body),
            params,
            tools,
            chain_request: chains.last().copied().unwrap_or([0; 32]),
            hashes: Arc::new(hashes),
            view: items.clone(),
            items,
            chains: Arc::new(chains),
            claims,
            original,
            strip_usage,
            compaction: None,
            mode: control.mode,
            observed: None,
            drop_block: false,
            recall: false,
            recall_rounds: state.config.compaction.recall_max_rounds,
            recall_offered: false,
            recall_withdrawn: false,
            client_compaction: super::control::is_client_compaction(&parts.headers),
            extra: Vec::new(),
            deferred: false,
            agent_tool: false,
            hidden_thinking: false,
            agent_offered: false,
            recall_spent: Default::default(),
            auth: engine::auth_headers(&parts.headers),
            streamed,
            started,
            started_ms,
            span,
        },
    );
    // The first request of a model asks the upstream for its window
    // (bounded in time), so that the check below already uses it.
    super::discovery::discover(state, &pending.model, &pending.auth).await;
    let agent_tool = state.config.agent_tool_for(&pending.tenant, &pending.model);
    match pending.mode {
        Mode::Auto | Mode::Manual => {}
        // What would have applied: recorded, never sent.
        Mode::Observe => {
            pending.observed = state
                .compactions
                .find_observed(&pending.tenant, &pending.chains);
            return Ok((pending, Compact::No));
        }
        Mode::Off => return Ok((pending, Compact::No)),
    }
    // Claude Code's own compaction request says so in its last message.
    pending.client_compaction |= pending.api == Api::Messages
        && pending
            .items
            .len()
            .checked_sub(1)
            .is_some_and(|last| messages::is_client_compaction(&pending.items.item(last)));
    // The client's own compaction request goes as it came while it fits;
    // otherwise with the stored compaction of its prefix, never a fresh
    // one: a summary of the proxy's summary would be the client's summary.
    if pending.client_compaction {
        let check = engine::FitCheck {
            tenant: &pending.tenant,
            conversation: &pending.ident.conversation,
            model: &pending.model,
            view: pending.view.clone(),
            hashes: Some(pending.hashes.clone()),
            tools: pending.tools.clone(),
            bytes: Some(raw_len),
        };
        if !matches!(engine::check_fit(state, check).await, engine::Fit::Fits) {
            if let Some(c) = state.compactions.find(&pending.tenant, &pending.chains) {
                pending.apply(c);
            }
        }
        return Ok((pending, Compact::No));
    }
    // A stored compaction covering a prefix of this request replaces it
    // (one still waiting for its first turn boundary only at one: see
    // `apply_stored`); a request too large to go without one
    // waits for one under way.
    let boundary = at_boundary(&pending.items);
    if let Some(c) = state.compactions.find(&pending.tenant, &pending.chains) {
        apply_stored(state, &mut pending, c, boundary, false);
    }
    let bytes = pending.compaction.is_none().then_some(raw_len);
    let check = engine::FitCheck {
        tenant: &pending.tenant,
        conversation: &pending.ident.conversation,
        model: &pending.model,
        view: pending.view.clone(),
        hashes: pending.view_hashes(),
        tools: pending.tools.clone(),
        bytes,
    };
    let mut compact = Compact::No;
    match engine::check_fit(state, check).await {
        engine::Fit::Fits => {}
        engine::Fit::Waited => {
            if let Some(c) = state.compactions.find(&pending.tenant, &pending.chains) {
                if apply_stored(state, &mut pending, c, boundary, true) {
                    compact = Compact::IfStillOver;
                }
            }
        }
        // Too large to go out as it is, and nothing under way: compact now
        // rather than let the upstream refuse it.
        engine::Fit::Over(tokens) => {
            // Unless another replica stored one for it since it looked.
            let newer = state
                .compactions
                .find(&pending.tenant, &pending.chains)
                .filter(|c| pending.compaction.as_ref().is_none_or(|p| p.id != c.id));
            if let Some(c) = newer {
                if apply_stored(state, &mut pending, c, boundary, true) {
                    compact = Compact::IfStillOver;
                }
            } else if pending.mode == Mode::Manual {
                // Nothing compacts on its own in manual mode: the request
                // goes as it is, and the reactive path answers a refusal.
                tracing::info!(tokens, "over the hard limit in manual mode: sent as it is");
            } else {
                compact = Compact::HardLimit(tokens);
            }
        }
    }
    // A compacted request whose tool outputs were shortened may read them
    // back, when it has tools of its own: `PendingExchange::apply` offers
    // the recall tool, for this and any later compaction of the request.
    // The model may ask for a compaction, when the tool is on.
    pending.offer_agent_tool(agent_tool);
    if pending.api == Api::Messages
        && messages::thinking_on(&pending.body)
        && state
            .compactions
            .had_hidden_round(&pending.tenant, &pending.ident.conversation)
    {
        pending.hidden_thinking = true;
        pending.drop_block = true;
    }
    Ok((pending, compact))
}

/// Whether a request is at a turn boundary: its last item is a new user
/// message (not a tool result, not the proxy's summary), in any of the
/// three APIs' shapes.
fn at_boundary(items: &ItemList) -> bool {
    items
        .len()
        .checked_sub(1)
        .is_some_and(|last| crate::compaction::items::is_user_message(&items.item(last)))
}

/// Applies stored compaction `c` found for the request, unless it still
/// waits for its first turn boundary and the request is inside a turn and
/// not `over` the hard limit: then the request goes with what it would
/// have had before `c` (the compaction `c` extends, if that one covers it
/// and no longer waits), and the threshold starts nothing after it. Once
/// applied, a compaction applies to every later request that extends its
/// prefix, boundary or not; its first application is counted as
/// `boundary` or `hard`. True when this was that first application.
fn apply_stored(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    c: Arc<Compaction>,
    boundary: bool,
    over: bool,
) -> bool {
    if !boundary && !over && state.compactions.is_waiting(&c.id) {
        pending.deferred = true;
        let base = c
            .base
            .as_deref()
            .and_then(|id| state.compactions.get(&pending.tenant, id))
            .filter(|b| {
                !state.compactions.is_waiting(&b.id)
                    && pending.chains.get(b.covered_len.wrapping_sub(1)) == Some(&b.covered_chain)
            });
        tracing::debug!(
            compaction = %c.id,
            base = base.as_ref().map_or("", |b| b.id.as_str()),
            "compaction waits for the turn boundary"
        );
        if let Some(b) = base {
            pending.apply(b);
        }
        return false;
    }
    let first = state.compactions.first_applied(&c.id);
    if first {
        let trigger = if boundary { "boundary" } else { "hard" };
        state.metrics.compaction_trigger(trigger);
        tracing::info!(compaction = %c.id, trigger, "waiting compaction applied");
    }
    pending.deferred = false;
    pending.apply(c);
    first
}

/// A header's text, if present, text and not blank.
fn header_text<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}
