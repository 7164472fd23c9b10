//! What the engine learned of the upstreams: whether each offers the
//! provider's compaction.

use std::sync::Mutex;

use crate::bounded::Generations;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What `auto` learned of each upstream and model: whether its
/// compaction exists. Kept in memory for the process's life (a restart
/// asks again, once); an upstream that errs otherwise (5xx, a timeout)
/// teaches nothing and is asked again next time.
pub struct Support {
    known: Mutex<Generations<(String, String), bool>>,
    /// Conversations, by (tenant, conversation), whose compacted request
    /// the upstream refused with the provider's window: their summary
    /// rung is local from then on.
    refused: Mutex<Generations<(String, String), ()>>,
}

impl Default for Support {
    fn default() -> Self {
        Self {
            known: Mutex::new(Generations::new(SUPPORT_ENTRIES)),
            refused: Mutex::new(Generations::new(SUPPORT_ENTRIES)),
        }
    }
}

impl Support {
    /// Whether the conversation's summary rung is local since the
    /// upstream refused its request compacted by the provider.
    pub(super) fn refused(&self, key: &(String, String)) -> bool {
        lock(&self.refused).renew(key).is_some()
    }

    /// The upstream refused the conversation's request compacted by the
    /// provider.
    pub(super) fn refuse(&self, key: (String, String)) {
        lock(&self.refused).insert(key, ());
    }

    pub(super) fn get(&self, key: &(String, String)) -> Option<bool> {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .renew(key)
            .copied()
    }

    pub(super) fn learn(&self, key: (String, String), offered: bool) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.insert(key.clone(), offered) != Some(offered) {
            tracing::info!(
                upstream = %key.0, model = %key.1, offered,
                "learned whether the upstream compacts for the summary rung"
            );
        }
    }
}

/// Upstreams × models whose answer [`Support`] keeps, per generation (see
/// [`Generations`]): one not used for longer is asked again.
const SUPPORT_ENTRIES: usize = 4096;
