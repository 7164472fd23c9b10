//! A client that keeps compacting: Claude Code's and Codex's own compaction
//! requests (the server recognises them) that come again before the last
//! one bought any turns. Each pays the upstream for a summary of a history
//! the client had just summarized (claude-code #24179: 211 compactions in
//! one session).
//!
//! A repeat is a compaction request of a conversation whose previous one
//! was answered, over the same history (the items before its last message,
//! which carries the ask), or within [`FEW_REQUESTS`] requests of it. A
//! failed compaction request that the client sends again is a retry, not a
//! repeat; one whose history is the previous one's and its answer goes on
//! from it (Gemini CLI's check of the snapshot it was just given), no
//! repeat either.
//!
//! The request still goes upstream as it came: it is the client's, and an
//! answer made up from the earlier summary would hand a client that found
//! that summary wanting (cut off, or too long to restart from) the same
//! again, in a loop that no longer even costs it a call to notice. What the
//! proxy does is count it (`compactor_client_compaction_repeats_total`,
//! shown on the admin page beside the proxy's own storms avoided), warn,
//! and back off its own part of the restart: the trail it appends to the
//! client's summary (see `engine::handoff`) is not appended after a repeat,
//! so the conversation restarts as small as the client made it.

use std::sync::Mutex;

use crate::bounded::Generations;
use crate::wire::ItemHash;

/// Conversations whose last compaction request is kept, per generation.
const KEPT: usize = 1024;

/// A compaction request at most this many requests after the
/// conversation's previous answered one is a repeat, whatever its history.
pub const FEW_REQUESTS: u32 = 3;

/// A conversation's last compaction request.
#[derive(Debug, Clone, Copy)]
struct Last {
    /// The chain hash of the history it compacted.
    history: ItemHash,
    /// Whether it was answered whole.
    answered: bool,
    /// Requests of the conversation since.
    since: u32,
    /// Repeats in a row up to it.
    in_a_row: u32,
}

/// A compaction request that repeats the conversation's last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeat {
    /// Over the same history.
    pub same_history: bool,
    /// Requests of the conversation between the two.
    pub requests_between: u32,
    /// Repeats in a row, this one included.
    pub in_a_row: u32,
}

/// The conversations' last compaction requests, by tenant and conversation.
pub(super) struct Repeats {
    last: Mutex<Generations<(String, String), Last>>,
}

impl Default for Repeats {
    fn default() -> Self {
        Self {
            last: Mutex::new(Generations::new(KEPT)),
        }
    }
}

impl Repeats {
    fn lock(&self) -> std::sync::MutexGuard<'_, Generations<(String, String), Last>> {
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A compaction request of `tenant`'s `conversation` over the history
    /// whose chain hash is `history`: the repeat it is, if it is one. One
    /// whose history is the last one's and its answer (`follows`, the
    /// chain hash of its history but its last item, when that item is an
    /// answer of the model) goes on from that compaction, as Gemini CLI's
    /// check of its snapshot does: no repeat.
    pub(super) fn asked(
        &self,
        tenant: &str,
        conversation: &str,
        (history, follows): (ItemHash, Option<ItemHash>),
    ) -> Option<Repeat> {
        let key = (tenant.to_string(), conversation.to_string());
        let mut last = self.lock();
        let repeat = last
            .get(&key)
            .filter(|l| l.answered && follows != Some(l.history))
            .filter(|l| l.history == history || l.since <= FEW_REQUESTS)
            .map(|l| Repeat {
                same_history: l.history == history,
                requests_between: l.since,
                in_a_row: l.in_a_row + 1,
            });
        last.insert(
            key,
            Last {
                history,
                answered: false,
                since: 0,
                in_a_row: repeat.map_or(0, |r| r.in_a_row),
            },
        );
        repeat
    }

    /// The conversation's compaction request was answered whole.
    pub(super) fn answered(&self, tenant: &str, conversation: &str) {
        self.update(tenant, conversation, |l| l.answered = true);
    }

    /// Another request of the conversation (not a compaction request).
    pub(super) fn went_on(&self, tenant: &str, conversation: &str) {
        self.update(tenant, conversation, |l| {
            l.since = l.since.saturating_add(1)
        });
    }

    fn update(&self, tenant: &str, conversation: &str, f: impl FnOnce(&mut Last)) {
        let mut last = self.lock();
        if last.is_empty() {
            return;
        }
        let key = (tenant.to_string(), conversation.to_string());
        if let Some(mut l) = last.get(&key).copied() {
            f(&mut l);
            last.insert(key, l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_follows_an_answered_request_over_the_same_history_or_soon() {
        let r = Repeats::default();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert_eq!(r.asked("t", "c", (a, None)), None, "the first");
        // Not answered: the next is a retry.
        assert_eq!(r.asked("t", "c", (a, None)), None);
        r.answered("t", "c");
        let again = r
            .asked("t", "c", (a, None))
            .expect("the same history again");
        assert!(again.same_history);
        assert_eq!((again.requests_between, again.in_a_row), (0, 1));
        r.answered("t", "c");
        for _ in 0..FEW_REQUESTS {
            r.went_on("t", "c");
        }
        let soon = r.asked("t", "c", (b, None)).expect("within a few requests");
        assert!(!soon.same_history);
        assert_eq!((soon.requests_between, soon.in_a_row), (FEW_REQUESTS, 2));
        r.answered("t", "c");
        for _ in 0..=FEW_REQUESTS {
            r.went_on("t", "c");
        }
        assert_eq!(r.asked("t", "c", (a, None)), None, "it bought turns");
        // Another tenant's, or another conversation's, is its own.
        r.answered("t", "c");
        assert_eq!(r.asked("u", "c", (a, None)), None);
        assert_eq!(r.asked("t", "d", (a, None)), None);
    }

    #[test]
    fn a_request_that_goes_on_from_the_last_ones_answer_follows_it() {
        let r = Repeats::default();
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        assert_eq!(r.asked("t", "c", (a, None)), None);
        r.answered("t", "c");
        // Its history is the last one's and that one's answer.
        assert_eq!(r.asked("t", "c", (b, Some(a))), None, "a check of it");
        r.answered("t", "c");
        // Going on from another answer, soon: a repeat.
        assert!(r.asked("t", "c", (c, Some(a))).is_some());
    }
}
