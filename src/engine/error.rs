//! Why a compaction gave nothing.

use crate::compaction::fit::CannotFit;

/// Why no compaction came out.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// No safe cut leaves anything to compact.
    #[error("no safe cut point")]
    NothingToCompact,
    /// The result would not be smaller (circuit breaker).
    #[error("compaction discarded: {before} tokens before, {after} after")]
    NoShrink {
        /// Tokens before.
        before: u64,
        /// Tokens after.
        after: u64,
    },
    /// Not even the irreducible core fits: decided from token counts,
    /// before any summarizer call.
    #[error(transparent)]
    CannotFit(#[from] CannotFit),
    /// A worker thread failed (panicked or was cancelled).
    #[error("internal: a worker thread failed")]
    Internal(#[source] tokio::task::JoinError),
}

impl CompactError {
    /// The answer to a client that asked for this compaction: its history
    /// gave nothing to compact, unless the proxy itself failed.
    pub fn into_refusal(self) -> crate::error::ProxyError {
        match self {
            CompactError::Internal(detail) => crate::error::ProxyError::internal(detail),
            other => crate::error::ProxyError::NothingToCompact(Box::new(other)),
        }
    }
}
