//! Per-turn bookkeeping of the recent conversations: the turn whose agent
//! compaction was scheduled, and the rounds the proxy answered itself. One
//! lock.

use std::sync::Mutex;

use super::guard::lock;
use crate::bounded::Generations;
use crate::wire::ItemHash;

/// Conversations whose agent turn and hidden rounds are kept, per
/// generation (see [`Generations`]): one not seen within this many others
/// is forgotten, as if this process had just started.
const PER_CONVERSATION: usize = 1 << 14;

/// The marks, under the part's lock, by (tenant, conversation).
struct Marks {
    /// The turn (see [`crate::compaction::agent_tool::turn_of`]) whose
    /// agent compaction was scheduled last (one per turn).
    agent_turns: Generations<(String, String), ItemHash>,
    /// Conversations on Anthropic Messages with thinking on where an
    /// answer followed a round the proxy answered itself.
    hidden_rounds: Generations<(String, String), ()>,
}

impl Default for Marks {
    fn default() -> Self {
        Self {
            agent_turns: Generations::new(PER_CONVERSATION),
            hidden_rounds: Generations::new(PER_CONVERSATION),
        }
    }
}

/// The per-turn marks of the recent conversations.
#[derive(Default)]
pub(super) struct Turns {
    marks: Mutex<Marks>,
}

impl Turns {
    /// The model asked for a compaction in `turn` of the conversation:
    /// true if it is the first request of that turn to ask.
    pub(super) fn schedule_agent_turn(
        &self,
        tenant: &str,
        conversation: &str,
        turn: ItemHash,
    ) -> bool {
        let key = (tenant.to_string(), conversation.to_string());
        lock(&self.marks).agent_turns.insert(key, turn) != Some(turn)
    }

    /// An answer of the conversation followed a round the proxy answered
    /// itself, with thinking on.
    pub(super) fn mark_hidden_round(&self, tenant: &str, conversation: &str) {
        let key = (tenant.to_string(), conversation.to_string());
        lock(&self.marks).hidden_rounds.insert(key, ());
    }

    /// Whether [`Turns::mark_hidden_round`] was called for the
    /// conversation (in this process).
    pub(super) fn had_hidden_round(&self, tenant: &str, conversation: &str) -> bool {
        let key = (tenant.to_string(), conversation.to_string());
        lock(&self.marks).hidden_rounds.renew(&key).is_some()
    }
}
