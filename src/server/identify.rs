//! The identify phase: runs once the request is read
//! and parsed, before anything goes upstream. Hashes the request's items
//! and parameters, names the conversation, opens the exchange (the request
//! moved into it whole): the match. Then plans what compaction the
//! request needs (a pure function of its mode and kind, and of the hard
//! limit's check), applies the stored compaction that covers it, and says
//! whether it needs one made now ([`Compact`], which the driver has
//! `server::compact_now` make). It must not compact, send the request or
//! answer the client.

use std::sync::Arc;
use std::time::Instant;

use super::exchange::{Digest, PendingExchange, Recorder, Timing, Unanswered};
use super::request::ReadRequest;
use crate::app::AppState;
use crate::compaction::{Compaction, Rung};
use crate::config::Mode;
use crate::engine;
use crate::error::ProxyError;
use crate::wire::item_hash;
use crate::wire::items::{ItemList, Tools};

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
    read: ReadRequest,
    started: Instant,
    started_ms: i64,
    recorder: Recorder,
) -> Result<(Unanswered, Compact), ProxyError> {
    let mut pending = matched(state, read, (started, started_ms), recorder).await?;
    let compact = prepare(state, &mut pending).await;
    Ok((pending, compact))
}

/// The match: hashes the request, names its conversation and opens its
/// exchange.
async fn matched(
    state: &Arc<AppState>,
    read: ReadRequest,
    (started, started_ms): (Instant, i64),
    recorder: Recorder,
) -> Result<Unanswered, ProxyError> {
    // A stalled database refuses the request now, before it reads the
    // database or anything goes upstream.
    state.store.available().map_err(ProxyError::store_down)?;
    let tenant = read.tenant();
    // Before the claims of recent requests are looked up (see Digest).
    let forgets = state.store.forgets();
    let (hashes, chains, claims) = read.items().hashes_and_chains(tenant);
    // With a store other replicas write, what this replica may lack of the
    // request (a longer recorded prefix, a compaction covering more) is
    // read now, in one round trip, awaited; the match and the compaction
    // lookups below use what it found (see `Compactions::prefetch`).
    let prefetched = state
        .compactions
        .prefetch(&state.conversations, tenant, &chains)
        .await;
    let mut ident = state.conversations.identify_with(
        tenant,
        read.explicit_key(),
        read.previous(),
        &chains,
        prefetched.chain.clone(),
        || carries_answer(read.items()),
    );
    // A client that names no session (Gemini CLI) goes on from its own
    // summary in a history that shares nothing with the one it compacted:
    // the summary's text leads to the conversation of its compaction
    // request, unless the request goes on from that summary already.
    if read.explicit_key().is_none() && read.previous().is_none() {
        if let Some((conversation, at)) = state.handoffs.linked(tenant, read.items()) {
            if ident.prefix.is_none_or(|p| p.len <= at) && ident.conversation != conversation {
                ident = crate::conversation::Identified {
                    conversation,
                    is_new: false,
                    prefix: None,
                    branched_from: None,
                };
            }
        }
    }
    state
        .compactions
        .matched(tenant, &ident.conversation, &prefetched);
    let span = tracing::Span::current();
    span.record("conversation", ident.conversation.as_str());
    span.record("model", read.model());
    state.metrics.conversation_seen(&ident.conversation);
    // The parameters' hash, through their bytes unless the proxy changed
    // the body (an expanded `previous_response_id`).
    let full_hash = || {
        let mut full = read.body().clone();
        Tools::restore(read.tools(), &mut full);
        item_hash(&full)
    };
    let params = match read.body_key() {
        Some(key) => state.item_caches.cached_hash(key, full_hash),
        None => full_hash(),
    };
    let id = state
        .store
        .next_exchange_id()
        .map_err(ProxyError::store_down)?;
    let pending = Unanswered::new(
        state,
        PendingExchange::open(
            read,
            id,
            ident,
            Digest::new(params, hashes, chains, claims, forgets),
            state.config.compaction.recall_max_rounds,
            Timing::new(started, started_ms, span),
            recorder,
        ),
    );
    // The first request of a model asks the upstream for its window
    // (bounded in time), so that the check below already uses it.
    let request = pending.request();
    super::discovery::discover(state, request.model(), request.auth()).await;
    Ok(pending)
}

/// What compaction a request matched needs, as far as its mode and kind
/// say before anything is looked up in size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Nothing: compaction is off.
    Nothing,
    /// Observe: what would have applied is recorded, never sent.
    Observe,
    /// Held out of compaction (`compaction.holdout_ratio`): observed.
    HoldOut,
    /// The client's own compaction request: as it came while it fits (the
    /// hand-off of its prefix applied, if one is stored), else with the
    /// stored compaction of its prefix, never a fresh one (a summary of the
    /// proxy's summary would be the client's summary).
    ClientCompaction,
    /// The stored compaction covering a prefix, then the hard limit's
    /// check ([`after_check`]).
    Stored,
}

/// The plan for a request in `mode`: `held_out` when its conversation is
/// held out of compaction and no compaction applies to it yet (it began
/// before the holdout: its request could need it to fit),
/// `client_compaction` when it is the client's own compaction request.
fn plan(mode: Mode, held_out: bool, client_compaction: bool) -> Plan {
    match mode {
        Mode::Auto if held_out => Plan::HoldOut,
        Mode::Observe => Plan::Observe,
        Mode::Off => Plan::Nothing,
        Mode::Auto | Mode::Manual if client_compaction => Plan::ClientCompaction,
        Mode::Auto | Mode::Manual => Plan::Stored,
    }
}

/// What a request over the hard limit needs after the check: `newer`,
/// a stored compaction another replica stored since the request looked,
/// applies; else one is made now, except in manual mode (nothing compacts
/// on its own then: the request goes as it is, and the reactive path
/// answers a refusal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Over {
    /// Apply the stored compaction found.
    ApplyNewer,
    /// Send it as it is.
    AsItIs,
    /// Compact it now.
    Compact,
}

fn after_check(newer: bool, mode: Mode) -> Over {
    if newer {
        Over::ApplyNewer
    } else if mode == Mode::Manual {
        Over::AsItIs
    } else {
        Over::Compact
    }
}

/// Carries out the plan for a request matched: applies the stored
/// compaction it takes and says what it needs compacted now.
async fn prepare(state: &Arc<AppState>, pending: &mut Unanswered) -> Compact {
    let request = pending.request();
    let agent_tool = state
        .config
        .agent_tool_for(request.tenant(), request.model());
    let held_out = request.mode() == Mode::Auto
        && state.config.held_out(pending.conversation())
        && find(state, pending).is_none();
    // Claude Code's own compaction request says so in its last message;
    // a new user message there (not a tool result, not the proxy's
    // summary) is a turn boundary. The last item, built once for both,
    // unless the client said already.
    let items = request.items();
    let format = request.api().format();
    let last = if pending.client_compaction() {
        None
    } else {
        items.len().checked_sub(1).map(|i| items.item(i))
    };
    let client_compaction = pending.client_compaction()
        || last
            .as_deref()
            .is_some_and(|last| format.is_client_compaction(last));
    let raw_len = request.raw_len();
    match plan(request.mode(), held_out, client_compaction) {
        Plan::Nothing => return Compact::No,
        Plan::HoldOut | Plan::Observe => {
            if held_out {
                pending.hold_out();
            }
            let observed = state
                .compactions
                .find_observed(pending.request().tenant(), pending.chains());
            pending.observe(observed);
            return Compact::No;
        }
        Plan::ClientCompaction => return compaction_of_the_client(state, pending, raw_len).await,
        Plan::Stored => {}
    }
    // A stored compaction covering a prefix of this request replaces it
    // (the model's own still waiting for its first turn boundary only at
    // one: see `apply_stored`); a request too large to go without one
    // waits for one under way.
    let boundary = last
        .as_deref()
        .is_some_and(crate::compaction::items::is_user_message);
    // The first request that goes on from a client's own summary: what the
    // summary left out of the trail is appended to it, by a compaction
    // stored for `find` to apply from now on (not in manual mode, where
    // nothing rewrites a request unasked).
    state
        .handoffs
        .went_on(pending.request().tenant(), pending.conversation());
    if pending.request().mode() == Mode::Auto {
        engine::after_client_compaction(
            state.as_ref(),
            &state.handoffs,
            pending.request().tenant(),
            pending.conversation(),
            pending.request().items(),
            pending.chains(),
        )
        .await;
    }
    if let Some(c) = find(state, pending) {
        apply_stored(state, pending, c, boundary, false);
    }
    let bytes = pending.compaction().is_none().then_some(raw_len);
    let check = pending.fit_check(bytes);
    let mut compact = Compact::No;
    match engine::check_fit(state, check).await {
        engine::Fit::Fits => {}
        engine::Fit::Waited => {
            if let Some(c) = find(state, pending) {
                if apply_stored(state, pending, c, boundary, true) {
                    compact = Compact::IfStillOver;
                }
            }
        }
        // Too large to go out as it is, and nothing under way: compact now
        // rather than let the upstream refuse it.
        engine::Fit::Over(tokens) => {
            // Unless another replica stored one for it since it looked.
            let newer =
                find(state, pending).filter(|c| pending.compaction().is_none_or(|p| p.id != c.id));
            match (
                after_check(newer.is_some(), pending.request().mode()),
                newer,
            ) {
                (Over::ApplyNewer, Some(c)) => {
                    if apply_stored(state, pending, c, boundary, true) {
                        compact = Compact::IfStillOver;
                    }
                }
                (Over::AsItIs, _) => {
                    tracing::info!(tokens, "over the hard limit in manual mode: sent as it is");
                }
                _ => compact = Compact::HardLimit(tokens),
            }
        }
    }
    // A compacted request whose tool outputs were shortened may read them
    // back, when it has tools of its own: `PendingExchange::apply` offers
    // the recall tool, for this and any later compaction of the request.
    // The model may ask for a compaction, when the tool is on.
    pending.offer_agent_tool(agent_tool);
    let request = pending.request();
    if request.api().format().signs_thinking(request.body())
        && state
            .compactions
            .had_hidden_round(request.tenant(), pending.conversation())
    {
        pending.mark_hidden_thinking();
    }
    compact
}

/// The client's own compaction request: what its summary may leave out of
/// the trail is kept for the request that goes on from it; it goes as it
/// came while it fits (the hand-off of its prefix applied, if one is
/// stored), else with the stored compaction of its prefix. Nothing is
/// compacted now for it.
async fn compaction_of_the_client(
    state: &Arc<AppState>,
    pending: &mut Unanswered,
    raw_len: usize,
) -> Compact {
    pending.treat_as_client_compaction();
    // The stored compaction of its prefix, and the hand-off that is or
    // that it extends: the trail of what the client compacted before, which
    // its history holds only as its summary.
    let found = find(state, pending);
    let handoff = engine::handoff_under(
        &state.compactions,
        pending.request().tenant(),
        found.clone(),
        pending.chains(),
    );
    // What its summary may leave out of the trail, for the request that
    // goes on from it.
    let request = pending.request();
    // The history it compacts: its items but the last, the ask; and that
    // history but its last item, when that is an answer of the model
    // (Gemini CLI's check of its snapshot goes on from the answer to its
    // compaction request).
    let items = request.items();
    let history = items.len().checked_sub(2);
    let chain = |i: Option<usize>| i.and_then(|i| pending.chains().get(i)).copied();
    let answered = history.filter(|&i| {
        let (role, kind) = items.role_and_type(i);
        crate::wire::class::is_model_output(&role, &kind)
    });
    // What the client compacted before: the hand-off's trail, else the
    // trail its last summary stated whole.
    let settled;
    let carried = match &handoff {
        Some(c) => c.facts.as_ref().map(|f| (c.covered_len, f)),
        None => {
            settled = state.handoffs.settled_under(
                request.tenant(),
                pending.conversation(),
                pending.chains(),
            );
            settled.as_ref().map(|(len, f)| (*len, f.as_ref()))
        }
    };
    let repeat = state.handoffs.asked(
        &state.metrics,
        (request.tenant(), pending.conversation()),
        (items, carried),
        (
            chain(history).unwrap_or_default(),
            chain(answered.and_then(|i| i.checked_sub(1))),
        ),
    );
    // A hand-off of its prefix goes with it, as with every request since:
    // it removes nothing the model summarizing should see, adds the trail
    // the client's last summary left out, and keeps the prefix the
    // upstream cached byte for byte (a summary of the proxy's goes only
    // when the history does not fit: the client's summary would be a
    // summary of it). Not with a repeat of the client's last compaction:
    // the proxy backs off its part.
    if let Some(c) = found.filter(|c| repeat.is_none() && c.rung == Rung::Handoff) {
        pending.apply(c);
    }
    let bytes = pending.compaction().is_none().then_some(raw_len);
    let check = pending.fit_check(bytes);
    if !matches!(engine::check_fit(state, check).await, engine::Fit::Fits) {
        if let Some(c) = find(state, pending) {
            pending.apply(c);
        }
    }
    Compact::No
}

/// The stored compaction that covers the longest prefix of the request, if
/// any.
fn find(state: &AppState, pending: &PendingExchange) -> Option<Arc<Compaction>> {
    state
        .compactions
        .find(pending.request().tenant(), pending.chains())
}

/// Applies stored compaction `c` found for the request, unless it is the
/// model's own (`compactor_compact`), still waits for its first turn
/// boundary, and the request is inside a turn and not `over` the hard
/// limit: then the request goes with what it would have had before `c`
/// (the compaction `c` extends, if that one covers it and no longer
/// waits), and the threshold starts nothing after it. A threshold
/// compaction applies on the next request that extends it; one computed for
/// an idle conversation on the first that comes after the upstream's cache
/// of its prefix expired (before, the request goes with what it had). Once applied,
/// a compaction applies to every later request that extends its prefix,
/// boundary or not; its first application is counted as `boundary` or
/// `hard`. True when this was that first application.
fn apply_stored(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    c: Arc<Compaction>,
    boundary: bool,
    over: bool,
) -> bool {
    // A threshold compaction covers a prefix that ends at a safe cut, so
    // it applies on the next request that extends it, inside a tool loop
    // too: waiting for the next user message (30–50 requests later in an
    // agent's session) let the conversation grow to the hard limit and
    // took the whole turn with it. The model's own request waits for the
    // end of its turn, as it asked.
    let soft = matches!(
        crate::metrics::trigger_of(&c.reason),
        Some("threshold" | "cold")
    );
    let base = || {
        c.base
            .as_deref()
            .and_then(|id| state.compactions.get(pending.request().tenant(), id))
            .filter(|b| !state.compactions.is_waiting(&b.id) && b.covers(pending.chains()))
    };
    // One computed for an idle conversation applies when it comes back
    // after the upstream's cache of its prefix expired (written again then
    // anyway), or over the hard limit; back sooner, the conversation goes
    // on with what it had, reading its prefix from the cache, and the
    // threshold compacts it as before.
    if engine::is_cold(&c.reason)
        && !over
        && state.compactions.is_waiting(&c.id)
        && !engine::idle_thread(pending.chains()).is_none_or(|thread| {
            state
                .compactions
                .cache_expired(pending.request().tenant(), &thread)
        })
    {
        if let Some(b) = base() {
            pending.apply(b);
        }
        return false;
    }
    if !boundary && !over && !soft && state.compactions.is_waiting(&c.id) {
        let base = base();
        tracing::debug!(
            compaction = %c.id,
            base = base.as_ref().map_or("", |b| b.id.as_str()),
            "compaction waits for the turn boundary"
        );
        pending.defer(base);
        return false;
    }
    let first = state.compactions.first_applied(&c.id);
    if first {
        let trigger = if boundary || (soft && !over) {
            "boundary"
        } else {
            "hard"
        };
        state.metrics.compaction_trigger(trigger);
        tracing::info!(compaction = %c.id, trigger, "waiting compaction applied");
    }
    pending.apply_due(c);
    first
}

/// Whether a request holds an answer of the model (a request that does not
/// is a session's opening).
fn carries_answer(items: &ItemList) -> bool {
    (0..items.len()).any(|i| {
        let (role, kind) = items.role_and_type(i);
        crate::wire::class::is_model_output(&role, &kind)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_follows_the_mode_then_the_kind_of_request() {
        assert_eq!(plan(Mode::Off, false, true), Plan::Nothing);
        assert_eq!(plan(Mode::Observe, false, true), Plan::Observe);
        assert_eq!(plan(Mode::Auto, true, true), Plan::HoldOut);
        // Only auto mode holds a conversation out.
        assert_eq!(plan(Mode::Manual, true, false), Plan::Stored);
        assert_eq!(plan(Mode::Manual, false, true), Plan::ClientCompaction);
        assert_eq!(plan(Mode::Auto, false, false), Plan::Stored);
    }

    #[test]
    fn over_the_hard_limit_a_newer_compaction_wins_and_manual_mode_sends_as_it_is() {
        assert_eq!(after_check(true, Mode::Manual), Over::ApplyNewer);
        assert_eq!(after_check(false, Mode::Manual), Over::AsItIs);
        assert_eq!(after_check(false, Mode::Auto), Over::Compact);
    }
}
