//! Background compactions: the decision after an exchange, the job it
//! starts, and, with a store shared by replicas, which replica computes it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::index::{lock, CLAIM_FOR, FOREIGN_POLL};
use super::{compact, Context, Input};
use crate::compaction::policy::decide;
use crate::store::LookUp;

/// After an exchange: decides from its usage and, past the trigger, starts a
/// background compaction that the next request will find.
pub fn after_exchange<S: Context>(state: &Arc<S>, input: Input, used: u64, estimated: bool) {
    let cfg = &state.config().compaction;
    let limits = state.model_limits(&input.model);
    let d = decide(used, estimated, &limits, cfg.warn_ratio);
    if !d.compact || !cfg.background || input.no_trigger {
        return;
    }
    // The client asked the provider to compact: a summary of the proxy's
    // own now would be a second compaction of the same history. Only the
    // hard limit and an upstream "too long" compact it.
    if input.provider_compaction {
        tracing::debug!(conversation = %input.conversation, "threshold compaction left to the provider the request asks");
        return;
    }
    let key = (input.tenant.clone(), input.conversation.clone());
    // A compaction stored after this request left was not applied to it; the
    // next request will be rewritten and its usage will tell. One the
    // request waited for and was sent with is no such compaction: the usage
    // is already its own.
    if lock(&state.compactions().newest)
        .get(&key)
        .is_some_and(|(t, id)| {
            *t >= input.requested_ms && input.base.as_ref().is_none_or(|b| &b.id != id)
        })
    {
        return;
    }
    let mut jobs = lock(&state.compactions().jobs);
    if jobs.get(&key).is_some_and(|rx| !*rx.borrow()) {
        return;
    }
    if state.compactions().backing_off(&input.tenant) {
        tracing::info!(conversation = %input.conversation, "compaction backed off: earlier compactions were never matched (client rewrites its history)");
        return;
    }
    let (tx, rx) = watch::channel(false);
    jobs.insert(key.clone(), rx);
    drop(jobs);
    let state = state.clone();
    let mut input = input;
    input.reason = format!("threshold: {}", d.reason());
    input.soft = true;
    tokio::spawn(async move {
        let tenant = input.tenant.clone();
        match claim(&state, &input).await {
            Claimed::Yes => {
                if let Err(e) = compact(&state, input.clone()).await {
                    tracing::info!(error = %e, "background compaction produced nothing");
                    state.compactions().job_failed(&tenant);
                }
                release(&state, &input).await;
            }
            Claimed::Elsewhere => {
                tracing::info!(conversation = %input.conversation, "compaction left to the replica that claimed or stored it");
                state.compactions().job_failed(&tenant);
            }
        }
        let _ = tx.send(true);
        let mut jobs = lock(&state.compactions().jobs);
        if jobs.get(&key).is_some_and(|rx| *rx.borrow()) {
            jobs.remove(&key);
        }
    });
}

/// Schedules the compaction the model asked for (`input.reason`,
/// `input.keep` set): computed now in the background, applied at the
/// conversation's next turn boundary. False when a job for the
/// conversation is under way already (it will be applied the same way).
pub fn schedule_agent<S: Context>(state: &Arc<S>, input: Input) -> bool {
    let key = (input.tenant.clone(), input.conversation.clone());
    let mut jobs = lock(&state.compactions().jobs);
    if jobs.get(&key).is_some_and(|rx| !*rx.borrow()) {
        return false;
    }
    let (tx, rx) = watch::channel(false);
    jobs.insert(key.clone(), rx);
    drop(jobs);
    let state = state.clone();
    let mut input = input;
    input.soft = true;
    tokio::spawn(async move {
        if let Claimed::Yes = claim(&state, &input).await {
            if let Err(e) = compact(&state, input.clone()).await {
                tracing::info!(error = %e, "the compaction the model asked for produced nothing");
            }
            release(&state, &input).await;
        }
        let _ = tx.send(true);
        let mut jobs = lock(&state.compactions().jobs);
        if jobs.get(&key).is_some_and(|rx| *rx.borrow()) {
            jobs.remove(&key);
        }
    });
    true
}

/// Whether this process computes the conversation's compaction.
pub(super) enum Claimed {
    /// It does (a store only it writes: always).
    Yes,
    /// Another replica computes it now, or stored one after the request
    /// that triggered this began (which the next request will find).
    Elsewhere,
}

/// Claims the computing of `input`'s compaction in a shared store: one
/// replica computes it, however many see the trigger.
pub(super) async fn claim<S: Context>(state: &Arc<S>, input: &Input) -> Claimed {
    let Some(shared) = state.compactions().shared.clone() else {
        return Claimed::Yes;
    };
    let (tenant, conversation) = (input.tenant.clone(), input.conversation.clone());
    let taker = shared.clone();
    let claimed = tokio::task::spawn_blocking(move || {
        taker.claim(&tenant, &conversation, CLAIM_FOR.as_millis() as i64)
    })
    .await
    .unwrap_or(false);
    if !claimed {
        return Claimed::Elsewhere;
    }
    // Claimed; but another replica may have stored one for this history
    // that the request missed (stored after it looked, not yet heard): the
    // next request, which extends this one, finds it. Asked before any
    // compaction is computed, so that replicas never compute two for one
    // history.
    let ask = LookUp {
        covering_from: Some(0),
        ..LookUp::default()
    };
    let found = shared.look_up(&input.tenant, &input.chains, ask).await;
    let applied = input.base.as_ref().map(|b| &b.id);
    let missed = found.compaction.is_some_and(|c| Some(&c.id) != applied);
    if missed {
        release(state, input).await;
        return Claimed::Elsewhere;
    }
    Claimed::Yes
}

/// Gives up the claim [`claim`] took.
pub(super) async fn release<S: Context>(state: &Arc<S>, input: &Input) {
    let Some(shared) = state.compactions().shared.clone() else {
        return;
    };
    let (tenant, conversation) = (input.tenant.clone(), input.conversation.clone());
    let _ = tokio::task::spawn_blocking(move || shared.release(&tenant, &conversation)).await;
}

/// Waits (within `wait`) for a compaction another replica computes for
/// the conversation, if one claimed it: true if one did.
pub(super) async fn wait_foreign<S: Context>(
    state: &Arc<S>,
    tenant: &str,
    conversation: &str,
    wait: Duration,
) -> bool {
    let Some(shared) = state.compactions().shared.clone() else {
        return false;
    };
    let (t, c) = (tenant.to_string(), conversation.to_string());
    let since = crate::ids::now_ms();
    let probe = move || {
        // A claim granted here means nobody computes one: given up at once.
        if shared.claim(&t, &c, FOREIGN_POLL.as_millis() as i64) {
            shared.release(&t, &c);
            return None;
        }
        Some(
            shared
                .newest_compaction_ms(&t, &c)
                .is_some_and(|ms| ms >= since),
        )
    };
    let deadline = Instant::now() + wait;
    loop {
        let probe = probe.clone();
        match tokio::task::spawn_blocking(probe).await.ok().flatten() {
            None => return false,
            Some(true) => return true,
            Some(false) if Instant::now() >= deadline => return true,
            Some(false) => tokio::time::sleep(FOREIGN_POLL).await,
        }
    }
}
