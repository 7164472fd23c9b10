//! What this process heard of the compactions other processes store (a
//! store shared by replicas): those announced and not yet indexed, and
//! which conversations and requests the store was asked for. One lock,
//! which the store's announcements take too.

use std::sync::{Arc, Mutex};

use super::guard::lock;
use crate::bounded::Generations;
use crate::store::StoredCompaction;
use crate::wire::ItemHash;

/// Conversations whose [`Hearing::asked`] is kept, and requests whose
/// [`Hearing::settled`], per generation: one asked for longer ago is asked
/// again.
const HEARD: usize = 1 << 16;

/// What was heard, under the part's lock.
struct Hearing {
    /// Those announced and not yet indexed (indexed at the next lookup).
    announced: Vec<StoredCompaction>,
    /// Per (tenant, conversation): the [`crate::store::Reads::hearing`]
    /// under which the store was last asked for the conversation's
    /// compactions. While it holds, every compaction stored since was
    /// announced: the conversation's newest is in memory. The recent
    /// conversations only.
    asked: Generations<(String, String), u64>,
    /// Requests (tenant, last chain) whose compaction lookup was made
    /// before they were matched: their next lookup looks in memory only.
    /// The recent requests only.
    settled: Generations<(String, ItemHash), ()>,
}

impl Default for Hearing {
    fn default() -> Self {
        Self {
            announced: Vec::new(),
            asked: Generations::new(HEARD),
            settled: Generations::new(HEARD),
        }
    }
}

/// What this process knows of the compactions other processes store.
#[derive(Default)]
pub(super) struct Heard {
    hearing: Arc<Mutex<Hearing>>,
}

impl Heard {
    /// What the store calls with each compaction another process stored.
    pub(super) fn announcer(&self) -> impl Fn(StoredCompaction) + Send + Sync + 'static {
        let hearing = self.hearing.clone();
        move |c| lock(&hearing).announced.push(c)
    }

    /// The compactions announced since the last call.
    pub(super) fn take_announced(&self) -> Vec<StoredCompaction> {
        std::mem::take(&mut lock(&self.hearing).announced)
    }

    /// The hearing under which the store was last asked for the
    /// conversation's compactions, if it is among the recent ones.
    pub(super) fn asked_under(&self, tenant: &str, conversation: String) -> Option<u64> {
        let hearing = lock(&self.hearing);
        hearing
            .asked
            .get(&(tenant.to_string(), conversation))
            .copied()
    }

    /// The store was asked for the conversation's compactions under
    /// `under`.
    pub(super) fn asked(&self, tenant: &str, conversation: &str, under: u64) {
        lock(&self.hearing)
            .asked
            .insert((tenant.to_string(), conversation.to_string()), under);
    }

    /// The request ending in `last` had its compaction lookup made before
    /// it was matched.
    pub(super) fn settle(&self, tenant: &str, last: ItemHash) {
        lock(&self.hearing)
            .settled
            .insert((tenant.to_string(), last), ());
    }

    /// Whether the request ending in `last` was settled (once: this takes
    /// it).
    pub(super) fn take_settled(&self, tenant: &str, last: ItemHash) -> bool {
        lock(&self.hearing)
            .settled
            .remove(&(tenant.to_string(), last))
            .is_some()
    }
}
