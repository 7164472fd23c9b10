//! What the engine uses of the process's shared state.

use std::sync::Arc;

use super::index::Compactions;
use crate::config::{Config, ModelLimits};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::tokens::TokenCounter;
use crate::upstream::Upstream;

/// What the engine uses of the process's shared state, and nothing more: the
/// composition root implements it, so the engine names no server, and a
/// test can run it over a context of its own.
pub trait Context: Send + Sync + 'static {
    /// The configuration.
    fn config(&self) -> &Config;
    /// Records (compactions are stored through it).
    fn store(&self) -> &Store;
    /// Token estimates.
    fn tokens(&self) -> &Arc<TokenCounter>;
    /// Stored compactions and running compaction jobs.
    fn compactions(&self) -> &Compactions;
    /// Where compactions, fallbacks and summary costs are counted.
    fn metrics(&self) -> &Metrics;
    /// The client that calls the summarizer.
    fn summarizer(&self) -> &Upstream;
    /// The limits of a model, its window as the upstream told it.
    fn model_limits(&self, model: &str) -> ModelLimits;
}
