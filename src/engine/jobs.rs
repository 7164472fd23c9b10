//! Background compactions: the decision after an exchange, the job it
//! starts, and, with a store shared by replicas, which replica computes it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::compute::compact;
use super::context::Context;
use super::index::{CLAIM_FOR, FOREIGN_POLL};
use super::input::Input;
use crate::compaction::policy::{decide, trigger_tokens};
use crate::compaction::Compaction;
use crate::store::{LookUp, Reads};

/// After an exchange: decides from its usage and, past the trigger, starts a
/// background compaction that the next request will find.
pub fn after_exchange<S: Context>(state: &Arc<S>, input: Input, used: u64, estimated: bool) {
    let cfg = &state.config().compaction;
    if !cfg.background || input.serving.no_trigger {
        return;
    }
    // The client asked the provider to compact: a summary of the proxy's
    // own now would be a second compaction of the same history. Only the
    // hard limit and an upstream "too long" compact it.
    if input.serving.provider_compaction {
        if crosses(state, &input, used, estimated).is_some() {
            tracing::debug!(conversation = %input.who.conversation, "threshold compaction left to the provider the request asks");
        }
        return;
    }
    let key = (input.who.tenant.clone(), input.who.conversation.clone());
    // The job under way was started by an earlier, shorter request: this
    // one is decided when it ends, from what it stored (a request sent the
    // moment the stream before ended gets here while the job of that
    // stream still runs). Left as the job's follow-up, which the job takes
    // to end.
    let running = state.compactions().running();
    let Some((input, _, _)) = running.unless_running(&key, (input, used, estimated)) else {
        return;
    };
    let Some(input) = needed(state, input, used, estimated) else {
        return;
    };
    let Some((input, tx)) = running.start(&key, (input, used, estimated), |input| {
        !backed_off(state, input)
    }) else {
        return;
    };
    let state = state.clone();
    tokio::spawn(async move {
        run_job(&state, input).await;
        follow_ups(&state, &key, &tx).await;
    });
}

/// Ends a job: first computes, as part of it, the compaction of an
/// exchange that crossed the trigger while it ran (requests over the hard
/// limit wait for all of it), then tells its waiters.
pub(super) async fn follow_ups<S: Context>(
    state: &Arc<S>,
    key: &(String, String),
    tx: &watch::Sender<bool>,
) {
    loop {
        let next = state.compactions().running().next_or_end(key, tx);
        let Some((next, used, estimated)) = next else {
            return;
        };
        if let Some(next) = needed(state, next, used, estimated).filter(|n| !backed_off(state, n)) {
            run_job(state, next).await;
        }
    }
}

/// The threshold's reason when `used` tokens cross it.
fn crosses<S: Context>(
    state: &Arc<S>,
    input: &Input,
    used: u64,
    estimated: bool,
) -> Option<String> {
    let limits = state.model_limits(&input.who.model);
    let d = decide(
        used,
        estimated,
        &limits,
        state.config().compaction.warn_ratio,
    );
    d.compact.then(|| format!("threshold: {}", d.reason()))
}

/// `input` made a background compaction's, if the exchange's `used`
/// tokens call for one: past the trigger still once the conversation's
/// newest compaction is counted, when the request was not sent with it.
fn needed<S: Context>(state: &Arc<S>, input: Input, used: u64, estimated: bool) -> Option<Input> {
    let reason = crosses(state, &input, used, estimated)?;
    let trigger = trigger_tokens(&state.model_limits(&input.who.model));
    if let Some(base) = input
        .request
        .base
        .as_ref()
        .filter(|b| bought_no_room(trigger, b, used))
    {
        state.metrics().storms().storm_avoided();
        tracing::warn!(
            conversation = %input.who.conversation,
            compaction = %base.id,
            tokens_after = base.tokens_after,
            used,
            trigger,
            "no threshold compaction: the last one left the conversation at its trigger and it has not grown since (what stays, the system, tools and newest turn, is about the trigger's size); the hard limit still compacts"
        );
        return None;
    }
    // A compaction stored after this request left was not applied to it;
    // the next request will be, which sends what it saves fewer. One the
    // request waited for and was sent with is no such compaction: the
    // usage is already its own. Nor is one the next request does not
    // apply: a request finds the compaction covering the longest prefix
    // of its items, and one computed from an earlier request, on an
    // earlier base, may cover less than the one this request was sent
    // with (counting its savings, the job was left out, and the next
    // request, over the hard limit with nothing under way, was compacted
    // in its own time).
    let stored = state.compactions().stored();
    let applies = |id: &String| {
        let (found, _) = stored.covering(&input.who.tenant, &input.request.chains, false);
        found.as_ref() == Some(id)
    };
    let newer = stored
        .newest(&input.who.tenant, &input.who.conversation)
        .filter(|(t, id)| {
            *t >= input.request.requested
                && input.request.base.as_ref().is_none_or(|b| &b.id != id)
                && applies(id)
        })
        .map(|(_, id)| id.clone());
    if let Some(id) = newer {
        // Unreadable: left to the next request's usage.
        let c = state.compactions().stored().body(&id)?;
        let had = input.request.base.as_ref().map_or(0, |b| b.saved());
        let next = used.saturating_sub(c.saved().saturating_sub(had));
        crosses(state, &input, next, true)?;
    }
    let mut input = input;
    input.ask.reason = reason;
    input.ask.soft = true;
    Some(input)
}

/// Whether the compaction `base` a request was built on bought no room: it
/// left the conversation at `trigger` already (what it must keep, the
/// system, the tools, the newest turn, is about that size), and the
/// conversation has not grown by a quarter of the trigger since. Another
/// compaction now would come out the same, and the next request would ask
/// for one again: a compaction storm, each paying a summary call. The hard
/// limit and an upstream "too long" still compact.
fn bought_no_room(trigger: u64, base: &Compaction, used: u64) -> bool {
    base.tokens_after >= trigger.saturating_mul(9) / 10
        && used < base.tokens_after.saturating_add(trigger / 4)
}

/// Whether the tenant's compactions are backed off (two in a row were
/// never matched: the client rewrites its history); counts this one.
fn backed_off<S: Context>(state: &Arc<S>, input: &Input) -> bool {
    let off = state.compactions().learned().backing_off(&input.who.tenant);
    if off {
        tracing::info!(conversation = %input.who.conversation, "compaction backed off: earlier compactions were never matched (client rewrites its history)");
    }
    off
}

/// One background compaction: claimed (with a shared store), computed,
/// released.
async fn run_job<S: Context>(state: &Arc<S>, input: Input) {
    let tenant = input.who.tenant.clone();
    match claim(state, &input).await {
        Claimed::Yes => {
            if let Err(e) = compact(state, input.clone()).await {
                tracing::info!(error = %e, "background compaction produced nothing");
                state.compactions().learned().job_failed(&tenant);
            }
            release(state, &input).await;
        }
        Claimed::Elsewhere => {
            tracing::info!(conversation = %input.who.conversation, "compaction left to the replica that claimed or stored it");
            state.compactions().learned().job_failed(&tenant);
        }
    }
}

/// Schedules the compaction the model asked for (`input.ask.reason`,
/// `input.ask.keep` set): computed now in the background, applied at the
/// conversation's next turn boundary. False when a job for the
/// conversation is under way already (it will be applied the same way).
pub fn schedule_agent<S: Context>(state: &Arc<S>, input: Input) -> bool {
    let key = (input.who.tenant.clone(), input.who.conversation.clone());
    let Some(tx) = state.compactions().running().start_unless_running(&key) else {
        return false;
    };
    let state = state.clone();
    let mut input = input;
    input.ask.soft = true;
    tokio::spawn(async move {
        if let Claimed::Yes = claim(&state, &input).await {
            if let Err(e) = compact(&state, input.clone()).await {
                tracing::info!(error = %e, "the compaction the model asked for produced nothing");
            }
            release(&state, &input).await;
        }
        follow_ups(&state, &key, &tx).await;
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
    let Some(shared) = state.compactions().shared().cloned() else {
        return Claimed::Yes;
    };
    let (tenant, conversation) = (input.who.tenant.clone(), input.who.conversation.clone());
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
    let found = shared
        .look_up(&input.who.tenant, &input.request.chains, ask)
        .await;
    let applied = input.request.base.as_ref().map(|b| &b.id);
    let missed = found.compaction.is_some_and(|c| Some(&c.id) != applied);
    if missed {
        release(state, input).await;
        return Claimed::Elsewhere;
    }
    Claimed::Yes
}

/// Gives up the claim [`claim`] took.
pub(super) async fn release<S: Context>(state: &Arc<S>, input: &Input) {
    let Some(shared) = state.compactions().shared().cloned() else {
        return;
    };
    let (tenant, conversation) = (input.who.tenant.clone(), input.who.conversation.clone());
    let _ = tokio::task::spawn_blocking(move || shared.release(&tenant, &conversation)).await;
}

/// Waits (within `wait`) for a compaction another replica computes for
/// the conversation, if one claimed it: true if one did.
///
/// The other replica's compaction is told by the conversation's newest
/// compaction changing from what the first look saw, not by its time
/// against this replica's clock: the two replicas' clocks need not agree.
pub(super) async fn wait_foreign<S: Context>(
    state: &Arc<S>,
    tenant: &str,
    conversation: &str,
    wait: Duration,
) -> bool {
    let Some(shared) = state.compactions().shared().cloned() else {
        return false;
    };
    wait_on(shared, tenant, conversation, wait).await
}

/// [`wait_foreign`] once the store is known to be shared.
async fn wait_on(shared: Arc<dyn Reads>, tenant: &str, conversation: &str, wait: Duration) -> bool {
    let (t, c) = (tenant.to_string(), conversation.to_string());
    let mut first: Option<Option<i64>> = None;
    let deadline = Instant::now() + wait;
    loop {
        let (shared, t, c) = (shared.clone(), t.clone(), c.clone());
        let look = move || {
            let newest = shared.newest_compaction_ms(&t, &c);
            let start = first.unwrap_or(newest);
            if newest != start {
                return (start, Some(true));
            }
            // A claim granted here means nobody computes one now: whether
            // one was finished meanwhile is the last look.
            if shared.claim(&t, &c, FOREIGN_POLL.as_millis() as i64) {
                shared.release(&t, &c);
                return (start, Some(shared.newest_compaction_ms(&t, &c) != start));
            }
            (start, None)
        };
        match tokio::task::spawn_blocking(look).await {
            Err(_) => return false,
            Ok((_, Some(done))) => return done,
            Ok((_, None)) if Instant::now() >= deadline => return true,
            Ok((start, None)) => {
                first = Some(start);
                tokio::time::sleep(FOREIGN_POLL).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::wait_on;
    use crate::store::{Queries, Reads, StoreError};

    /// Another replica as the store shows it: it holds the claim while
    /// `holds` says so, and its compaction appears (stamped `finished_ms` by
    /// its own clock) from the `lands_at`-th look at the newest one on.
    struct Other {
        looks: AtomicUsize,
        lands_at: usize,
        finished_ms: i64,
        holds: fn(usize) -> bool,
    }

    impl Queries for Other {
        fn views(&self) -> Result<Box<dyn crate::store::sql::Sql>, StoreError> {
            Err(StoreError::Closed)
        }
    }

    impl Reads for Other {
        fn compaction(&self, _: &str) -> Option<crate::compaction::Compaction> {
            None
        }
        fn conversation_of_key(&self, _: &str, _: &str) -> Option<String> {
            None
        }
        fn response_history(&self, _: &str, _: &str) -> Option<Vec<serde_json::Value>> {
            None
        }
        fn shared(&self) -> bool {
            true
        }
        fn newest_compaction_ms(&self, _: &str, _: &str) -> Option<i64> {
            let n = self.looks.fetch_add(1, Ordering::SeqCst) + 1;
            // An earlier compaction, then the other replica's new one.
            Some(if n >= self.lands_at {
                self.finished_ms
            } else {
                1_000
            })
        }
        fn claim(&self, _: &str, _: &str, _: i64) -> bool {
            !(self.holds)(self.looks.load(Ordering::SeqCst))
        }
    }

    async fn wait(other: Other) -> bool {
        let shared: Arc<dyn Reads> = Arc::new(other);
        // Far longer than the test's own bound: an answer within it came
        // from what the store showed, not from running out of time.
        let waiting = wait_on(shared, "t", "c", Duration::from_secs(600));
        tokio::time::timeout(Duration::from_secs(20), waiting)
            .await
            .expect("the wait ended when the store said, not at its deadline")
    }

    #[tokio::test]
    async fn a_compaction_stamped_by_a_clock_behind_this_one_ends_the_wait() {
        // The other replica's clock is an hour behind: its compaction's
        // time is earlier than this replica's now, yet it is new.
        let behind = crate::ids::now_ms() - 3_600_000;
        let other = Other {
            looks: AtomicUsize::new(0),
            lands_at: 3,
            finished_ms: behind,
            holds: |_| true,
        };
        assert!(wait(other).await);
    }

    #[tokio::test]
    async fn a_claim_granted_with_nothing_new_means_nobody_computes_one() {
        let other = Other {
            looks: AtomicUsize::new(0),
            lands_at: usize::MAX,
            finished_ms: 0,
            holds: |_| false,
        };
        assert!(!wait(other).await);
    }

    #[tokio::test]
    async fn a_compaction_finished_between_two_looks_is_seen_after_the_claim() {
        // The other replica holds the claim for the first two looks and has
        // released it by the third, its compaction stored just before.
        let other = Other {
            looks: AtomicUsize::new(0),
            lands_at: 3,
            finished_ms: 2_000,
            holds: |looks| looks < 2,
        };
        assert!(wait(other).await);
    }
}
