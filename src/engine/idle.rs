//! Compaction when the cache is cold anyway. A conversation past the cold
//! threshold (`compaction.cold_ratio`) that stays idle for most of its
//! cache's lifetime (`compaction.cache_ttl_secs`; an hour when its
//! breakpoints ask for `ttl: "1h"`) gets a compaction computed in the
//! background, while the upstream still holds its prefix (the summary call
//! reads it from the cache). The compaction waits: it applies when the
//! conversation comes back after the cache expired, when its prefix must be
//! written again regardless, so the compaction's own write costs nothing
//! extra; back sooner, it goes on with what it had (see
//! `server::identify`), and the threshold compacts it as before.
//!
//! The time is the process's monotonic clock: a wall clock that moves
//! backwards changes nothing here.

use std::sync::Arc;
use std::time::Duration;

use super::compute::compact;
use super::context::Context;
use super::input::Input;
use super::jobs::{claim, follow_ups, release};
use super::running::Idle;
use crate::compaction::policy::{cold_tokens, trigger_tokens};
use crate::wire::ItemHash;
use serde_json::Value;

/// The reason's first word of such a compaction (see
/// [`crate::metrics::reason_kind`]).
pub const COLD: &str = "cold";

/// The share of the cache's lifetime a conversation stays idle before its
/// compaction is computed: the rest is left for the summary call to read
/// the prefix while the upstream still holds it.
const IDLE_SHARE: f64 = 0.8;

/// How long the upstream keeps a Messages prefix whose breakpoints ask for
/// it.
const HOUR: Duration = Duration::from_secs(3600);

/// What names a conversation here: the chain hash of the client's first
/// two items (its first user message and answer), which stays the same for
/// as long as the conversation goes on, whatever the rest of the request
/// does (a client that moves its breakpoints every request changes the
/// chain of its last items, and with it the conversation the proxy matches
/// it to). Two conversations that begin alike share it, and with it only
/// the timer: a compaction applies to the request whose items it covers.
pub fn thread(chains: &[ItemHash]) -> Option<ItemHash> {
    chains.get(1).or(chains.first()).copied()
}

/// Whether a compaction is one computed for an idle conversation.
pub fn is_cold(reason: &str) -> bool {
    crate::metrics::reason_kind(reason) == COLD
}

/// How long the upstream's cache keeps `input`'s prefix idle: the setting,
/// or an hour when a breakpoint of the request asks for `ttl: "1h"`.
fn ttl_of<S: Context>(state: &Arc<S>, input: &Input) -> Duration {
    let secs = state.config().compaction.cache_ttl_secs;
    let setting = Duration::from_secs_f64(secs);
    let hour = input
        .request
        .sent
        .as_ref()
        .is_some_and(|s| asks_hour(s.body().get("system")) || asks_hour(s.body().get("tools")))
        || (0..input.request.view.len())
            .rev()
            .take(4)
            .any(|i| asks_hour(Some(input.request.view.item(i).as_ref())));
    if hour {
        setting.max(HOUR)
    } else {
        setting
    }
}

/// Whether a value (a message, `system`, the tools) holds a breakpoint
/// that asks for an hour.
fn asks_hour(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Array(list)) => list.iter().any(|x| asks_hour(Some(x))),
        Some(Value::Object(o)) => {
            o.get("cache_control")
                .and_then(|c| c.get("ttl"))
                .and_then(Value::as_str)
                == Some("1h")
                || asks_hour(o.get("content"))
        }
        _ => false,
    }
}

/// After an answered exchange that used `used` tokens: notes that the
/// upstream read the prefix now, and watches the conversation's idle time
/// when it is past the cold threshold but under the trigger.
pub fn after_exchange<S: Context>(state: &Arc<S>, input: &Input, used: u64) {
    let cfg = &state.config().compaction;
    let Some(thread) = thread(&input.request.chains) else {
        return;
    };
    let limits = state.model_limits(&input.who.model);
    let watched = cfg.background
        && cfg.cache_ttl_secs > 0.0
        && !input.serving.observe
        && !input.serving.no_trigger
        && !input.serving.provider_compaction
        && used >= cold_tokens(&limits, cfg.cold_ratio)
        && used < trigger_tokens(&limits);
    let ttl = if watched {
        ttl_of(state, input)
    } else {
        Duration::from_secs_f64(cfg.cache_ttl_secs)
    };
    state
        .compactions()
        .read_now(&input.who.tenant, &thread, ttl);
    let key = (input.who.tenant.clone(), thread);
    let running = state.compactions().running();
    if !watched {
        running.unwatch_idle(&key);
        return;
    }
    if !running.watch_idle(key.clone(), input.clone()) {
        // Its watcher runs already, and sees the new time.
        return;
    }
    let state = state.clone();
    tokio::spawn(async move { watch_idle(&state, key, ttl, used).await });
}

/// Sleeps until the conversation has been idle for [`IDLE_SHARE`] of `ttl`
/// (each exchange in between moves that on), then computes its compaction.
async fn watch_idle<S: Context>(state: &Arc<S>, key: (String, ItemHash), ttl: Duration, used: u64) {
    let wait = ttl.mul_f64(IDLE_SHARE);
    let input = loop {
        match state.compactions().running().idle_due(&key, wait) {
            Idle::Gone => return,
            Idle::Due(input) => break *input,
            Idle::Until(due) => tokio::time::sleep_until(due.into()).await,
        }
    };
    // Not while a compaction of the conversation is computed.
    let thread = key.1;
    let key = (input.who.tenant.clone(), input.who.conversation.clone());
    let Some(tx) = state.compactions().running().start_unless_running(&key) else {
        return;
    };
    let mut input = input;
    input.ask.reason = format!(
        "{COLD}: idle for {:.0}% of the cache's {}s lifetime at reported {used} tokens, past the cold threshold",
        IDLE_SHARE * 100.0,
        ttl.as_secs_f64()
    );
    input.ask.soft = true;
    if let super::jobs::Claimed::Yes = claim(state, &input).await {
        match compact(state, input.clone()).await {
            Ok(c) => {
                tracing::info!(compaction = %c.id, conversation = %input.who.conversation, "compaction for an idle conversation, applied when it comes back after its cache expired");
                // The summary call that repeated the request read its
                // prefix: the upstream keeps it from now on.
                if c.reason.contains("; summary from the cached request")
                    && !c.reason.contains("cached request missed")
                {
                    state
                        .compactions()
                        .read_now(&input.who.tenant, &thread, ttl);
                }
            }
            Err(e) => {
                tracing::info!(error = %e, "the compaction for an idle conversation produced nothing")
            }
        }
        release(state, &input).await;
    }
    follow_ups(state, &key, &tx).await;
}
