//! The composition root: [`AppState`], what every request handler shares,
//! and its construction from the config (store, journal replay, indexes
//! loaded from the store's snapshot).
//!
//! Above every layer it assembles and below the edges that serve it
//! (`server`, `admin`, `cli`); it names neither of those.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use crate::background::Background;
use crate::bounded::Generations;
use crate::config::{Config, ModelLimits};
use crate::conversation::ConversationIndex;
use crate::engine::Compactions;
use crate::store::{Reads, SharedDatabase, Store};
use crate::tokens::TokenCounter;
use crate::upstream::Upstream;
use crate::wire::items::ItemCaches;

/// Most models whose limits [`AppState`] keeps looked up (the least
/// recently used go first).
const MODELS_KEPT: usize = 1024;

/// Everything a request handler needs, shared by all connections.
pub struct AppState {
    /// The effective configuration.
    pub config: Config,
    /// The upstream client.
    pub upstream: Upstream,
    /// Records.
    pub store: Arc<Store>,
    /// The store's point reads (compaction bodies, explicit keys,
    /// `previous_response_id` histories).
    pub reads: Arc<dyn Reads>,
    /// The database other replicas write too, when the records are in one
    /// (PostgreSQL's; for the readiness probe and the gauges).
    pub postgres: Option<Arc<dyn SharedDatabase>>,
    /// Prefix / key / response-id → conversation.
    pub conversations: ConversationIndex,
    /// Token estimates.
    pub tokens: Arc<TokenCounter>,
    /// What is remembered of recent requests to read the next ones faster
    /// (tenant-scoped), and item hashes by their bytes: this state's own.
    pub item_caches: Arc<ItemCaches>,
    /// Salt of tenant hashes (per store).
    pub tenant_salt: [u8; 32],
    /// Stored compactions and running compaction jobs.
    pub compactions: Compactions,
    /// The trails of histories clients compacted themselves, until the
    /// request that goes on from their summary.
    pub handoffs: crate::engine::Handoffs,
    /// Prometheus metrics (`GET /metrics`).
    pub metrics: crate::metrics::Metrics,
    /// The thread for the accounting that follows each answer.
    pub background: &'static Background,
    /// [`Config::model_limits`] of the models seen, looked up once each,
    /// and whether a `[[models]]` entry gave them.
    /// Model names come from clients, so the table is bounded.
    limits: Mutex<Generations<String, (ModelLimits, bool)>>,
    /// The windows the upstream told (see [`crate::windows`]).
    pub windows: crate::windows::Windows,
    /// Set when the shutdown grace period is over and the connections still
    /// open are dropped: what they were answering was cut by the proxy, not
    /// left by the client.
    pub(crate) cut_at_shutdown: AtomicBool,
    /// Unix ms the upstream last answered an exchange whole (or a
    /// readiness probe): what `/readyz` looks at first.
    upstream_reached_ms: AtomicI64,
    /// Readiness probes of the upstream go one at a time, and the last
    /// one's outcome is kept with when it finished (Unix ms): the probes
    /// that waited for it take it, success or failure, so a burst of
    /// `/readyz` asks a hanging upstream once.
    pub(crate) probing: tokio::sync::Mutex<Option<(i64, bool, serde_json::Value)>>,
}

impl AppState {
    /// Notes that the upstream answered just now.
    pub fn upstream_reached(&self) {
        self.upstream_reached_ms
            .store(crate::ids::now_ms(), Ordering::Relaxed);
    }

    /// Unix ms the upstream last answered (0: not since start).
    pub fn upstream_reached_at(&self) -> i64 {
        self.upstream_reached_ms.load(Ordering::Relaxed)
    }

    /// Opens the store and builds the upstream client.
    pub fn open(config: Config) -> anyhow::Result<Arc<Self>> {
        let crate::store::Opened {
            store,
            mut snapshot,
            reads,
            shared: postgres,
        } = crate::store::open(&config, crate::conversation::STORE_LIMITS)?;
        let by_key = reads.clone();
        let conversations = ConversationIndex::from_snapshot(
            &snapshot,
            Arc::new(move |tenant: &str, key: &str| by_key.conversation_of_key(tenant, key)),
        )
        .shared_with(reads.clone());
        let stored = std::mem::take(&mut snapshot.compactions);
        // The windows are stored by the URL as shown (see
        // `discovery::tell`), trimmed as the upstream client keeps it.
        let windows = crate::windows::Windows::from_stored(
            &crate::config::shown_url(config.upstream.base_url.trim_end_matches('/')),
            std::mem::take(&mut snapshot.windows),
        );
        let by_id = reads.clone();
        let compactions =
            Compactions::from_stored(stored, Arc::new(move |id: &str| by_id.compaction(id)))
                .shared_with(reads.clone());
        let metrics = crate::metrics::Metrics::new();
        store.observe_commits(Box::new(metrics.commit_observer()));
        let state = Arc::new(AppState {
            compactions,
            handoffs: Default::default(),
            upstream: Upstream::new(&config.upstream)?,
            store,
            reads,
            postgres,
            conversations,
            tokens: TokenCounter::new_warm(),
            item_caches: Arc::default(),
            tenant_salt: snapshot.salt,
            metrics,
            background: Background::global(),
            limits: Mutex::new(Generations::new(MODELS_KEPT / 2)),
            windows,
            cut_at_shutdown: AtomicBool::new(false),
            upstream_reached_ms: AtomicI64::new(0),
            probing: tokio::sync::Mutex::new(None),
            config,
        });
        // What another replica (or the CLI) deletes is forgotten here too.
        let weak = Arc::downgrade(&state);
        state.reads.on_forgotten(Box::new(move |payload| {
            if let Some(state) = weak.upgrade() {
                state.forget_deleted(payload);
            }
        }));
        Ok(state)
    }

    /// Forgets what a deletion elsewhere took (a [`retention::FORGET_CHANNEL`]
    /// payload): its conversations are no longer continued, their
    /// compactions no longer applied, and items are sent with the next
    /// records again, since some may be gone. An empty payload forgets
    /// only the items (listening stopped or started again, and a deletion
    /// may have gone unheard).
    ///
    /// [`retention::FORGET_CHANNEL`]: crate::store::retention::FORGET_CHANNEL
    pub fn forget_deleted(&self, payload: &str) {
        let gone = crate::store::retention::forgotten(payload);
        for (tenant, conversation, compactions) in &gone {
            self.conversations.forget(tenant, conversation);
            self.compactions.forget(tenant, compactions);
        }
        self.forget_stored_items();
        if gone.is_empty() {
            tracing::debug!("deletions may have gone unheard: items are sent whole again");
        } else {
            tracing::info!(
                conversations = gone.len(),
                "forgot what another process deleted"
            );
        }
    }

    /// Forgets which items are stored, after a deletion: the next records
    /// send every item's body again until each is known anew.
    pub fn forget_stored_items(&self) {
        self.store.forget_known_items();
        self.item_caches.forget_recent();
    }

    /// The limits of `model`: [`Config::model_limits`] (which every
    /// exchange needs and the config cannot change while the process runs)
    /// with the window the upstream told applied.
    pub fn model_limits(&self, model: &str) -> ModelLimits {
        self.model_window(model).0
    }

    /// [`AppState::model_limits`] and where its window came from.
    pub fn model_window(&self, model: &str) -> (ModelLimits, crate::windows::Source) {
        let configured = {
            let mut known = self.limits.lock().unwrap_or_else(|p| p.into_inner());
            match known.renew(model) {
                Some(l) => *l,
                None => {
                    let l = self.config.model_limits_sourced(model);
                    known.insert(model.to_string(), l);
                    l
                }
            }
        };
        self.told_over(model, configured)
    }

    /// [`AppState::model_window`] without adding `model` to the models
    /// seen (the banner's, the metrics'): for a listing, which may name
    /// hundreds the proxy never serves.
    pub fn listed_model_window(&self, model: &str) -> (ModelLimits, crate::windows::Source) {
        self.told_over(model, self.config.model_limits_sourced(model))
    }

    /// `configured` (the limits and whether a `[[models]]` entry gave them)
    /// with what the upstream told of `model` applied.
    fn told_over(
        &self,
        model: &str,
        (limits, from_config): (ModelLimits, bool),
    ) -> (ModelLimits, crate::windows::Source) {
        let source = if from_config {
            crate::windows::Source::Config
        } else {
            crate::windows::Source::Table
        };
        crate::windows::effective(limits, source, self.windows.told(model).as_ref())
    }

    /// The effective window of every model seen or told, by name:
    /// (model, tokens, source).
    pub fn models_seen(&self) -> Vec<(String, u64, &'static str)> {
        let mut names: Vec<String> = self
            .limits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        names.extend(self.windows.all().into_iter().map(|t| t.model));
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|m| {
                let (l, s) = self.model_window(&m);
                (m, l.context_window, s.as_str())
            })
            .collect()
    }

    /// Why an answer was dropped before its end: its client left, or the
    /// proxy cut it at the end of the shutdown grace period.
    pub fn cut_reason(&self) -> &'static str {
        if self.cut_at_shutdown.load(Ordering::Acquire) {
            "the proxy shut down"
        } else {
            "client disconnected"
        }
    }
}

impl crate::engine::Context for AppState {
    fn config(&self) -> &Config {
        &self.config
    }
    fn store(&self) -> &Store {
        &self.store
    }
    fn tokens(&self) -> &Arc<TokenCounter> {
        &self.tokens
    }
    fn compactions(&self) -> &Compactions {
        &self.compactions
    }
    fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }
    fn summarizer(&self) -> &Upstream {
        &self.upstream
    }
    fn model_limits(&self, model: &str) -> ModelLimits {
        AppState::model_limits(self, model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_in(dir: &std::path::Path) -> Arc<AppState> {
        let mut config = Config::default();
        config.store.path = dir.join("c.db").display().to_string();
        config.upstream.discover_windows = false;
        AppState::open(config).expect("open state")
    }

    /// Two proxies in one process keep their recent requests apart: what
    /// one remembers of a tenant's conversation the other does not find.
    #[test]
    fn two_states_in_one_process_share_no_item_caches() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (open_in(da.path()), open_in(db.path()));
        let tenant = "the-same-tenant-key";
        let first = bytes::Bytes::from_static(br#"{"messages":[{"a":1},{"b":2}]}"#);
        let split = a
            .item_caches
            .split_body_reusing(&first, "messages", tenant)
            .unwrap();
        crate::wire::items::ItemList::raw(Vec::new(), first.clone(), split.spans.unwrap())
            .with_caches(a.item_caches.clone())
            .hashes_and_chains(tenant);
        let next = br#"{"messages":[{"a":1},{"b":2},{"c":3}]}"#;
        let reuse = |s: &AppState| {
            s.item_caches
                .split_body_reusing(next, "messages", tenant)
                .and_then(|split| split.reuse)
                .is_some()
        };
        assert!(reuse(&a), "a remembers its own request");
        assert!(!reuse(&b), "b found a's request");
    }

    /// A table of models past its bound keeps the ones looked up last, not
    /// whichever happened to arrive after it was last emptied.
    #[test]
    fn the_models_table_keeps_the_recent_models_past_its_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = open_in(dir.path());
        let names: Vec<String> = (0..MODELS_KEPT + MODELS_KEPT / 4)
            .map(|i| format!("model-{i}"))
            .collect();
        for name in &names {
            state.model_limits(name);
        }
        let seen: std::collections::HashSet<String> =
            state.models_seen().into_iter().map(|(m, _, _)| m).collect();
        assert!(seen.len() <= MODELS_KEPT, "{}", seen.len());
        for name in &names[names.len() - MODELS_KEPT / 2..] {
            assert!(seen.contains(name), "{name} was dropped");
        }
    }
}
