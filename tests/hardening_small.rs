//! Small holes of the fourth round, each through real sockets where the
//! behaviour is seen there: per-conversation memory that only grew, a
//! gateway's one small model, a stream larger than what is kept of it.

mod support;

use compactor::engine::Compactions;

/// The turn each conversation last asked for a compaction in, and the
/// conversations that had a round the proxy answered itself, were kept for
/// every conversation ever seen: a proxy serving many short conversations
/// grew without bound. Both keep the recent conversations, like every
/// other cache: one the proxy has not seen for long is forgotten (its
/// agent turn can be scheduled again), a recent one is not.
#[test]
fn per_conversation_marks_keep_the_recent_conversations_only() {
    let c = Compactions::default();
    let turn = [7u8; 32];
    assert!(c.schedule_agent_turn("t", "old", turn));
    assert!(!c.schedule_agent_turn("t", "old", turn), "one per turn");
    c.mark_hidden_round("t", "old");
    c.mark_hidden_round("t", "recent");
    for i in 0..100_000 {
        let conversation = format!("c{i}");
        c.schedule_agent_turn("t", &conversation, turn);
        c.mark_hidden_round("t", &conversation);
        if i % 1000 == 0 {
            assert!(c.had_hidden_round("t", "recent"), "seen again, so kept");
        }
    }
    assert!(c.had_hidden_round("t", "recent"));
    assert!(!c.had_hidden_round("t", "old"), "forgotten");
    assert!(
        c.schedule_agent_turn("t", "old", turn),
        "its turn forgotten too"
    );
}
