//! After a client's own compaction (Claude Code's, Codex's): the trail of
//! the history the client compacted — rules, files changed, commands with
//! their exit status — is taken from its compaction request
//! ([`Handoffs::remember`]); on the first request that goes on from the
//! client's summary, what that summary left out of it is appended to the
//! summary's message by a compaction of rung `handoff` covering the items
//! through it ([`after_client_compaction`]). Stored like every compaction,
//! it gives every later request of the conversation the same bytes, so the
//! upstream's cache of the prefix holds, and a later compaction of the
//! proxy's own starts from it. A compaction request that repeats the
//! client's last one (see `engine::repeats`) leaves its trail out: the
//! proxy backs off its part of the restart.

use std::sync::{Arc, Mutex};

use crate::bounded::Generations;
use crate::compaction::summary::{is_handoff, left_out, trail_of, with_block, Facts};
use crate::compaction::{items, Compaction, Rung};
use crate::wire::items::ItemList;
use crate::wire::ItemHash;

use super::context::Context;
use super::repeats::{Repeat, Repeats};

/// Conversations kept per generation between a client's compaction request
/// and the request that goes on from its summary.
const KEPT: usize = 1024;

/// The trails of the histories clients compacted themselves, by tenant and
/// conversation, until the request that goes on from the summary.
pub struct Handoffs {
    trails: Mutex<Generations<(String, String), Arc<Facts>>>,
    repeats: Repeats,
}

impl Default for Handoffs {
    fn default() -> Self {
        Self {
            trails: Mutex::new(Generations::new(KEPT)),
            repeats: Repeats::default(),
        }
    }
}

impl Handoffs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Generations<(String, String), Arc<Facts>>> {
        self.trails
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The client's own compaction request of `tenant`'s `conversation`
    /// was answered whole.
    pub fn answered(&self, tenant: &str, conversation: &str) {
        self.repeats.answered(tenant, conversation);
    }

    /// A request of `tenant`'s `conversation` that is not a compaction
    /// request of its client's.
    pub fn went_on(&self, tenant: &str, conversation: &str) {
        self.repeats.went_on(tenant, conversation);
    }

    /// The client's own compaction request of `tenant`'s `conversation`,
    /// its items `request`, the last the ask: its trail is kept for the
    /// request that goes on from its summary, unless it repeats the
    /// conversation's last one (see `engine::repeats`): then it is counted
    /// in `metrics`, logged, and no trail is appended after it.
    pub fn asked(
        &self,
        metrics: &crate::metrics::Metrics,
        (tenant, conversation): (&str, &str),
        request: &ItemList,
        history: ItemHash,
    ) -> Option<Repeat> {
        let Some(repeat) = self.repeats.asked(tenant, conversation, history) else {
            self.remember(tenant, conversation, request);
            return None;
        };
        self.forget(tenant, conversation);
        metrics.storms().client_compaction_repeated();
        tracing::warn!(
            conversation,
            same_history = repeat.same_history,
            requests_between = repeat.requests_between,
            in_a_row = repeat.in_a_row,
            "the client compacts again before its last compaction bought any turns: forwarded as it came, counted, and no trail appended to its summary"
        );
        Some(repeat)
    }

    /// Keeps the trail of `history`, the items of the client's own
    /// compaction request in `tenant`'s `conversation` (nothing when it
    /// has none).
    fn remember(&self, tenant: &str, conversation: &str, history: &ItemList) {
        let trail = trail_of(&history.values());
        if trail.rules.is_empty() && trail.files.is_empty() && trail.commands.is_empty() {
            return;
        }
        self.lock().insert(
            (tenant.to_string(), conversation.to_string()),
            Arc::new(trail),
        );
    }

    /// Whether a trail waits for `tenant`'s `conversation`.
    fn waiting(&self, tenant: &str, conversation: &str) -> Option<Arc<Facts>> {
        self.lock()
            .get(&(tenant.to_string(), conversation.to_string()))
            .cloned()
    }

    fn forget(&self, tenant: &str, conversation: &str) {
        self.lock()
            .remove(&(tenant.to_string(), conversation.to_string()));
    }
}

/// For a request of `tenant`'s `conversation` (its items and their chain
/// hashes) whose client compacted by itself: when it carries the client's
/// summary message and the summary left out part of the trail, the
/// compaction that appends that part to it, stored and indexed, for the
/// request to apply. `None` when no trail waits, the request carries no
/// summary, or the summary states the whole trail (the trail is then
/// forgotten, as it is once its compaction is stored).
pub async fn after_client_compaction<C: Context>(
    state: &C,
    handoffs: &Handoffs,
    tenant: &str,
    conversation: &str,
    request: &ItemList,
    chains: &[ItemHash],
) -> Option<Arc<Compaction>> {
    let trail = handoffs.waiting(tenant, conversation)?;
    let at = (0..request.len()).find(|&i| {
        let item = request.item(i);
        items::is_user_message(&item) && is_handoff(&items::text_of(&item))
    })?;
    handoffs.forget(tenant, conversation);
    let summary = request.item(at);
    let block = left_out(&trail, &items::text_of(&summary))?;
    let mut replacement: Vec<serde_json::Value> =
        (0..at).map(|i| request.item(i).into_owned()).collect();
    replacement.push(with_block(&summary, &block));
    let tokens = state.tokens();
    let before: u64 = (0..=at).map(|i| tokens.count_text(&request.json(i))).sum();
    let added = tokens.count_text(&block);
    let lines = block.lines().filter(|l| l.starts_with("- ")).count();
    let c = Compaction {
        tokens_before: before,
        tokens_after: before + added,
        items_kept: at + 1,
        summary: Some(block),
        // Carried into the proxy's own next compaction, as any
        // compaction's facts are: the trail outlives it too.
        facts: Some((*trail).clone()),
        ..Compaction::made_now(
            tenant,
            conversation,
            (at + 1, *chains.get(at)?),
            replacement,
            Rung::Handoff,
            format!(
                "handoff: the client's own summary, with {lines} lines of the trail it left out"
            ),
        )
    };
    if let Err(e) = state.store().record_compaction(c.clone()).await {
        tracing::error!(error = %e, "hand-off compaction not recorded");
    }
    let c = Arc::new(c);
    state.compactions().insert(c.clone());
    state.metrics().compaction(c.rung.as_str(), "handoff", 0);
    tracing::info!(
        compaction = %c.id,
        conversation,
        "the client's own summary left out part of the trail: appended"
    );
    Some(c)
}
