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
//!
//! A client that compacts again sends a history that opens with its last
//! summary, not the block the proxy appended to it: the trail of its next
//! compaction request is the hand-off's trail, stored with it, merged with
//! that of the items after the hand-off's prefix ([`handoff_under`]), so
//! what only the first hand-off held — a rule stated early, a file changed
//! early — follows the next summary too. A first summary that stated the
//! whole trail gets no hand-off: its trail is kept with where the summary
//! sits ([`Handoffs::settled_under`]), and plays the hand-off's part for
//! the conversation's next compaction request (the history then holds it
//! only as the client's prose, which the trail is not read from).
//!
//! Claude Code and Codex name their session in every request, so the
//! request after their compaction is of the same conversation. Gemini CLI
//! names none, and goes on from a history that opens with its summary:
//! the text of each answer to a client's own compaction request that
//! named no session is kept, as a hash, with its conversation
//! ([`Handoffs::summarized`]), and a request naming none that opens with
//! that text goes on in it ([`Handoffs::linked`]). By tenant: the same
//! text sent with another credential is another conversation.

use std::sync::{Arc, Mutex};

use crate::bounded::Generations;
use crate::compaction::summary::{
    carried_text, carried_texts, is_handoff, left_out, trail_of, with_block, Facts,
};
use crate::compaction::{covers_prefix, items, Compaction, Rung};
use crate::wire::class::is_model_output;
use crate::wire::items::ItemList;
use crate::wire::ItemHash;

use super::context::Context;
use super::index::Compactions;
use super::repeats::{Repeat, Repeats};

/// Conversations kept per generation between a client's compaction request
/// and the request that goes on from its summary.
const KEPT: usize = 1024;

/// The compactions looked through, from the one covering a client's
/// compaction request, for the hand-off it extends.
const BASES: usize = 16;

/// Summaries kept per tenant: the answers to its latest compaction
/// requests that named no session.
const SUMMARIES_PER_TENANT: usize = 4;

/// The first items of a request looked at for a summary it goes on from:
/// Gemini CLI's opens with its session's context, then the summary.
const OPENING: usize = 4;

/// The trail of a history the client compacted, whose summary stated it
/// whole: what the summary's message and the items before it stand for.
struct Settled {
    /// The items through the summary's message, and their chain hash.
    covered_len: usize,
    covered_chain: ItemHash,
    facts: Arc<Facts>,
}

/// An answer to a client's own compaction request that named no session.
struct Summary {
    /// Its text's length and hash (see [`carried_text`]).
    len: usize,
    hash: [u8; 32],
    conversation: String,
}

/// The trails of the histories clients compacted themselves, by tenant and
/// conversation, until the request that goes on from the summary; the
/// summaries answered to clients that name no session, by tenant.
pub struct Handoffs {
    trails: Mutex<Generations<(String, String), Arc<Facts>>>,
    settled: Mutex<Generations<(String, String), Arc<Settled>>>,
    summaries: Mutex<Generations<String, Vec<Summary>>>,
    repeats: Repeats,
}

impl Default for Handoffs {
    fn default() -> Self {
        Self {
            trails: Mutex::new(Generations::new(KEPT)),
            settled: Mutex::new(Generations::new(KEPT)),
            summaries: Mutex::new(Generations::new(KEPT)),
            repeats: Repeats::default(),
        }
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Handoffs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Generations<(String, String), Arc<Facts>>> {
        locked(&self.trails)
    }

    /// The answer `answer` (its items) to a client's own compaction
    /// request of `tenant`'s `conversation` that named no session: the
    /// request that goes on from its text goes on in `conversation`.
    pub fn summarized(&self, tenant: &str, conversation: &str, answer: &[serde_json::Value]) {
        let text: String = answer.iter().map(carried_text).collect();
        let text = text.trim();
        if text.is_empty() {
            return;
        }
        let summary = Summary {
            len: text.len(),
            hash: *blake3::hash(text.as_bytes()).as_bytes(),
            conversation: conversation.to_string(),
        };
        let mut summaries = locked(&self.summaries);
        let mut kept = summaries.remove(tenant).unwrap_or_default();
        kept.retain(|s| s.hash != summary.hash);
        if kept.len() == SUMMARIES_PER_TENANT {
            kept.remove(0);
        }
        kept.push(summary);
        summaries.insert(tenant.to_string(), kept);
    }

    /// The conversation a request of `tenant` that names no session goes
    /// on in, when one of its opening user messages (before the first
    /// answer of the model), or a text part of one, is the text of a
    /// summary answered to the tenant ([`Handoffs::summarized`]), and
    /// where that message is.
    pub fn linked(&self, tenant: &str, request: &ItemList) -> Option<(String, usize)> {
        let summaries = locked(&self.summaries);
        let kept = summaries.get(tenant)?;
        for i in 0..request.len().min(OPENING) {
            let (role, kind) = request.role_and_type(i);
            if is_model_output(&role, &kind) {
                break;
            }
            if role != "user" {
                continue;
            }
            for text in carried_texts(&request.item(i)) {
                let mut hash = None;
                let found = kept.iter().rev().find(|s| {
                    s.len == text.len()
                        && s.hash
                            == *hash
                                .get_or_insert_with(|| blake3::hash(text.as_bytes()))
                                .as_bytes()
                });
                if let Some(s) = found {
                    return Some((s.conversation.clone(), i));
                }
            }
        }
        None
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
    /// its items `request`, the last the ask, over the history whose chain
    /// hash is `history` (and `follows`, that history's but its last item
    /// when that item is an answer of the model): its trail is kept for the
    /// request that goes on from its summary, unless it repeats the
    /// conversation's last one (see `engine::repeats`): then it is counted
    /// in `metrics`, logged, and no trail is appended after it. `carried`,
    /// the items of a prefix of `request` and their trail, what the client
    /// compacted before (of the hand-off of that prefix, [`handoff_under`],
    /// or settled, [`Handoffs::settled_under`]).
    pub fn asked(
        &self,
        metrics: &crate::metrics::Metrics,
        (tenant, conversation): (&str, &str),
        (request, carried): (&ItemList, Option<(usize, &Facts)>),
        history: (ItemHash, Option<ItemHash>),
    ) -> Option<Repeat> {
        let Some(repeat) = self.repeats.asked(tenant, conversation, history) else {
            self.remember(tenant, conversation, request, carried);
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
    /// has none): of those after the prefix `carried` covers merged onto
    /// its trail, when it covers one.
    fn remember(
        &self,
        tenant: &str,
        conversation: &str,
        history: &ItemList,
        carried: Option<(usize, &Facts)>,
    ) {
        let trail = match carried {
            Some((from, facts)) => {
                let after: Vec<serde_json::Value> = (from.min(history.len())..history.len())
                    .map(|i| history.item(i).into_owned())
                    .collect();
                trail_of(&after, Some(facts))
            }
            None => trail_of(&history.values(), None),
        };
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

    /// `trail`, stated whole by the client's summary at item `at` of a
    /// request of `tenant`'s `conversation` (its chain hashes `chains`).
    fn settle(
        &self,
        (tenant, conversation): (&str, &str),
        (at, chains): (usize, &[ItemHash]),
        trail: Arc<Facts>,
    ) {
        let Some(&covered_chain) = chains.get(at) else {
            return;
        };
        locked(&self.settled).insert(
            (tenant.to_string(), conversation.to_string()),
            Arc::new(Settled {
                covered_len: at + 1,
                covered_chain,
                facts: trail,
            }),
        );
    }

    /// The trail a client's summary stated whole, in `tenant`'s
    /// `conversation`, when a request (its chain hashes `chains`) still
    /// goes on from that summary: the items it stands for and the trail.
    pub fn settled_under(
        &self,
        tenant: &str,
        conversation: &str,
        chains: &[ItemHash],
    ) -> Option<(usize, Arc<Facts>)> {
        let settled = locked(&self.settled)
            .get(&(tenant.to_string(), conversation.to_string()))
            .cloned()?;
        covers_prefix(chains, settled.covered_len, &settled.covered_chain)
            .then(|| (settled.covered_len, settled.facts.clone()))
    }
}

/// The hand-off `found` is or extends: `found`, the stored compaction of
/// `tenant` covering the longest prefix of a request (its chain hashes
/// `chains`), when it is one, else the nearest of its bases that is one and
/// covers a prefix of the request. A compaction of the proxy's after a
/// hand-off carries the hand-off's trail merged with the facts of the
/// items it summarized, which the request still holds: the hand-off's own
/// trail, merged with the items after its prefix, counts each once.
pub fn handoff_under(
    compactions: &Compactions,
    tenant: &str,
    found: Option<Arc<Compaction>>,
    chains: &[ItemHash],
) -> Option<Arc<Compaction>> {
    let mut c = found?;
    for _ in 0..BASES {
        if c.rung == Rung::Handoff {
            return c.covers(chains).then_some(c);
        }
        c = compactions.get(tenant, c.base.as_deref()?)?;
    }
    None
}

/// For a request of `tenant`'s `conversation` (its items and their chain
/// hashes) whose client compacted by itself: when it carries the client's
/// summary message and the summary left out part of the trail, the
/// compaction that appends that part to it, stored and indexed, for the
/// request to apply. `None` when no trail waits, the request carries no
/// summary, or the summary states the whole trail (the trail is then kept
/// as settled, [`Handoffs::settled_under`], for the conversation's next
/// compaction request; it is forgotten as waiting, as it is once its
/// compaction is stored).
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
    let Some(block) = left_out(&trail, &items::text_of(&summary)) else {
        handoffs.settle((tenant, conversation), (at, chains), trail);
        return None;
    };
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn user(text: &str) -> serde_json::Value {
        json!({"role": "user", "parts": [{"text": text}]})
    }

    fn answer(text: &str) -> Vec<serde_json::Value> {
        vec![json!({"role": "model", "parts": [{"text": text}]})]
    }

    #[test]
    fn the_hand_off_under_a_compaction_is_found_through_its_bases() {
        let compactions = Compactions::default();
        let chains: Vec<ItemHash> = (0..6u8).map(|i| [i; 32]).collect();
        let stored = |id: &str, len: usize, rung: Rung, base: Option<&str>| {
            let mut c =
                crate::compaction::test_compaction(id, "t", len, chains[len - 1], Vec::new());
            c.rung = rung;
            c.base = base.map(String::from);
            let c = Arc::new(c);
            compactions.insert(c.clone());
            c
        };
        let handoff = stored("cmp_h", 2, Rung::Handoff, None);
        let summary = stored("cmp_s", 5, Rung::Summary, Some("cmp_h"));
        let found = |c: &Arc<Compaction>, chains: &[ItemHash]| {
            handoff_under(&compactions, "t", Some(c.clone()), chains).map(|c| c.id.clone())
        };
        assert_eq!(found(&handoff, &chains).as_deref(), Some("cmp_h"));
        assert_eq!(found(&summary, &chains).as_deref(), Some("cmp_h"));
        // Another tenant's base is none of its, nor a prefix the request
        // does not share.
        assert!(handoff_under(&compactions, "u", Some(summary.clone()), &chains).is_none());
        let mut other = chains.clone();
        other[1] = [9; 32];
        assert_eq!(found(&summary, &other), None);
        let lone = stored("cmp_p", 4, Rung::Prune, None);
        assert_eq!(found(&lone, &chains), None);
    }

    #[test]
    fn a_summary_answered_leads_its_tenants_opening_to_its_conversation() {
        let h = Handoffs::default();
        h.summarized(
            "t",
            "c1",
            &answer("  <state_snapshot>one</state_snapshot>\n"),
        );
        let opening = |texts: &[&str]| -> ItemList {
            let mut v: Vec<serde_json::Value> = texts.iter().map(|t| user(t)).collect();
            v.push(json!({"role": "model", "parts": [{"text": "Got it."}]}));
            v.push(user("<state_snapshot>one</state_snapshot>"));
            v.into()
        };
        let request = opening(&["context", "<state_snapshot>one</state_snapshot>"]);
        assert_eq!(h.linked("t", &request), Some(("c1".to_string(), 1)));
        assert_eq!(h.linked("u", &request), None, "another tenant's");
        // Past the model's first answer, the text is the history's, not
        // what the request goes on from.
        assert_eq!(h.linked("t", &opening(&["context"])), None);
        // A tenant keeps its latest few.
        for i in 0..SUMMARIES_PER_TENANT {
            h.summarized("t", &format!("d{i}"), &answer(&format!("summary {i}")));
        }
        assert_eq!(h.linked("t", &request), None, "the oldest went");
        let last = SUMMARIES_PER_TENANT - 1;
        let request = opening(&[&format!("summary {last}")]);
        assert_eq!(h.linked("t", &request), Some((format!("d{last}"), 0)));
    }
}
