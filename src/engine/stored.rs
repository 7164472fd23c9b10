//! What is stored: the compactions this process knows, found by the
//! covered prefix's chain hash per tenant, and the bodies used lately (the
//! others are read from the store when a request needs them). One lock;
//! a body is read from the store without it.

use foldhash::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::guard::lock;
use crate::bounded::Generations;
use crate::compaction::{rewrite, Compaction};
use crate::store::StoredCompaction;
use crate::wire::ItemHash;

/// Compaction bodies kept in memory, per generation (see [`Generations`]):
/// those used lately. A body holds its replacement items and extracted
/// facts (tens of kilobytes); the others are read from the store when a
/// request needs them.
pub(super) const BODIES: usize = 256;

/// Conversations whose newest compaction is kept, per generation: only one
/// stored while a request was under way matters (see
/// [`Stored::newest`]), and that is among the latest.
const NEWEST: usize = 1 << 16;

/// Reads a compaction's body from the store, by id.
pub type LoadCompaction = Arc<dyn Fn(&str) -> Option<Compaction> + Send + Sync>;

/// A stored compaction as the registry finds it: its id and how much it
/// covers.
struct Entry {
    id: String,
    covered_len: usize,
}

impl rewrite::Covering for Entry {
    fn covered_len(&self) -> usize {
        self.covered_len
    }
}

/// Per tenant, the compactions by covered chain (without bodies).
type ByTenant = HashMap<String, HashMap<ItemHash, Entry>>;

/// What is stored, under the part's lock.
struct Index {
    /// Every stored compaction, by tenant and covered chain (without
    /// bodies): as many as the store holds, a few dozen bytes each.
    applied: ByTenant,
    /// The same for observe mode's would-be compactions: found only to
    /// figure what a request would have saved, never applied.
    observed: ByTenant,
    /// The tenant of every stored compaction, by id (to expand
    /// `compaction` items).
    by_id: HashMap<String, String>,
    /// Per (tenant, conversation): when its newest compaction became
    /// visible here, and its id. The recent conversations only.
    newest: Generations<(String, String), (Instant, String)>,
    /// The compaction bodies used lately, by id.
    bodies: Generations<String, Arc<Compaction>>,
}

impl Default for Index {
    fn default() -> Self {
        Self {
            applied: HashMap::default(),
            observed: HashMap::default(),
            by_id: HashMap::default(),
            newest: Generations::new(NEWEST),
            bodies: Generations::new(BODIES),
        }
    }
}

/// The compactions stored, and how to read the bodies not kept.
#[derive(Default)]
pub(super) struct Stored {
    index: Mutex<Index>,
    /// Reads a body from the store (none: only those kept are found).
    load: Option<LoadCompaction>,
}

impl Stored {
    /// Nothing yet, the bodies read with `load`.
    pub(super) fn reading(load: LoadCompaction) -> Self {
        Self {
            index: Mutex::default(),
            load: Some(load),
        }
    }

    /// Indexes a stored compaction (its body is read when needed).
    pub(super) fn index(&self, c: StoredCompaction) {
        let StoredCompaction {
            id,
            tenant,
            conversation,
            covered_len,
            covered_chain,
            created_ms: _,
            observed,
        } = c;
        // The time it became visible here, not when it was computed (by
        // another process's clock, or this one's before it was set back): a
        // request that started before this moment may have missed it. The
        // monotonic clock, so that one indexed later is always the newer.
        let visible = Instant::now();
        let mut index = lock(&self.index);
        let key = (tenant.clone(), conversation);
        if index.newest.get(&key).is_none_or(|at| visible >= at.0) {
            index.newest.insert(key, (visible, id.clone()));
        }
        index.by_id.insert(id.clone(), tenant.clone());
        let by_tenant = if observed {
            &mut index.observed
        } else {
            &mut index.applied
        };
        by_tenant
            .entry(tenant)
            .or_default()
            .insert(covered_chain, Entry { id, covered_len });
    }

    /// Adds a compaction just stored, its body kept.
    pub(super) fn insert(&self, c: Arc<Compaction>) {
        self.index(StoredCompaction::from(&*c));
        self.keep_body(c);
    }

    /// Keeps a body read from the store.
    pub(super) fn keep_body(&self, c: Arc<Compaction>) {
        lock(&self.index).bodies.insert(c.id.clone(), c);
    }

    /// Whether the compaction `id` is indexed.
    pub(super) fn knows(&self, id: &str) -> bool {
        lock(&self.index).by_id.contains_key(id)
    }

    /// Whether the body of `id` is kept in memory.
    pub(super) fn body_kept(&self, id: &str) -> bool {
        lock(&self.index).bodies.get(id).is_some()
    }

    /// The longest of `tenant`'s compactions (`observed`: observe mode's)
    /// that covers a prefix of the request: its id and covered length, or
    /// `None` and 0.
    pub(super) fn covering(
        &self,
        tenant: &str,
        chains: &[ItemHash],
        observed: bool,
    ) -> (Option<String>, usize) {
        let index = lock(&self.index);
        let by_tenant = if observed {
            &index.observed
        } else {
            &index.applied
        };
        by_tenant
            .get(tenant)
            .and_then(|m| rewrite::find(chains, m))
            .map_or((None, 0), |e| (Some(e.id.clone()), e.covered_len))
    }

    /// A compaction's body: kept, or read from the store (a stored one
    /// that cannot be read is treated as absent: the request goes as the
    /// client sent it).
    pub(super) fn body(&self, id: &str) -> Option<Arc<Compaction>> {
        {
            let mut index = lock(&self.index);
            // Used again: kept into the next generation.
            if let Some(c) = index.bodies.renew(id) {
                return Some(c.clone());
            }
        }
        let load = self.load.as_ref()?;
        // Read without the lock: other requests' lookups go on meanwhile.
        let c = match load(id) {
            Some(c) => Arc::new(c),
            None => {
                tracing::warn!(compaction = %id, "stored compaction could not be read");
                return None;
            }
        };
        self.keep_body(c.clone());
        Some(c)
    }

    /// Whether the compaction `id` is `tenant`'s.
    pub(super) fn belongs(&self, id: &str, tenant: &str) -> bool {
        lock(&self.index).by_id.get(id).is_some_and(|t| t == tenant)
    }

    /// Forgets `tenant`'s compactions `ids`: no request is rewritten by
    /// them any more, nor offered them as what it would have saved.
    pub(super) fn forget(&self, tenant: &str, ids: &[String]) {
        let mut index = lock(&self.index);
        for id in ids {
            index.by_id.remove(id);
        }
        let Index {
            applied, observed, ..
        } = &mut *index;
        for by_tenant in [applied, observed] {
            if let Some(m) = by_tenant.get_mut(tenant) {
                m.retain(|_, e| !ids.contains(&e.id));
            }
        }
    }

    /// When the conversation's newest compaction became visible here, and
    /// its id, if it is among the recent ones.
    pub(super) fn newest(&self, tenant: &str, conversation: &str) -> Option<(Instant, String)> {
        let key = (tenant.to_string(), conversation.to_string());
        lock(&self.index).newest.get(&key).cloned()
    }

    /// Number of stored compactions (applied, not observed).
    pub(super) fn len(&self) -> usize {
        lock(&self.index).applied.values().map(HashMap::len).sum()
    }

    /// Number of bodies kept in memory.
    #[cfg(test)]
    pub(super) fn bodies_kept(&self) -> usize {
        lock(&self.index).bodies.len()
    }
}
