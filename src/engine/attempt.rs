//! How each compaction attempt ended, kept for the admin API: the latest
//! of each recent conversation.

use std::sync::{Arc, Mutex};

use super::error::CompactError;
use super::guard::lock;
use crate::bounded::Generations;
use crate::compaction::Compaction;

/// How a compaction attempt ended, as the admin API reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Attempt {
    /// Unix ms it ended.
    pub at_ms: i64,
    /// `applied`, `discarded` (it would not have shrunk the request) or
    /// `failed`.
    pub result: &'static str,
    /// Estimated tokens of the request before.
    pub tokens_before: Option<u64>,
    /// Estimated tokens after (what a discarded one would have sent).
    pub tokens_after: Option<u64>,
    /// The rung, when applied.
    pub rung: Option<&'static str>,
    /// The compaction stored, when applied.
    pub compaction: Option<String>,
    /// Why it failed.
    pub error: Option<String>,
}

impl Attempt {
    /// A stored compaction as the attempt that made it (computed by
    /// another replica, whose attempts this one does not hold).
    pub fn stored(c: &Compaction) -> Self {
        Attempt {
            at_ms: c.created_ms,
            result: "applied",
            tokens_before: Some(c.tokens_before),
            tokens_after: Some(c.tokens_after),
            rung: Some(c.rung.as_str()),
            compaction: Some(c.id.clone()),
            error: None,
        }
    }

    /// An attempt another replica kept in the shared store.
    pub fn shared(r: &crate::store::AttemptRecord) -> Self {
        Attempt {
            at_ms: r.at_ms,
            result: if r.result == "discarded" {
                "discarded"
            } else {
                "failed"
            },
            tokens_before: r.tokens_before,
            tokens_after: r.tokens_after,
            rung: None,
            compaction: None,
            error: r.error.clone(),
        }
    }

    /// The attempt as a shared store keeps it, if it stored nothing.
    pub(super) fn unstored(&self) -> Option<crate::store::AttemptRecord> {
        (self.result != "applied").then(|| crate::store::AttemptRecord {
            at_ms: self.at_ms,
            result: self.result.to_string(),
            tokens_before: self.tokens_before,
            tokens_after: self.tokens_after,
            error: self.error.clone(),
        })
    }

    pub(super) fn of(result: &Result<Arc<Compaction>, CompactError>) -> Self {
        let mut a = Attempt {
            at_ms: crate::ids::now_ms(),
            result: "failed",
            tokens_before: None,
            tokens_after: None,
            rung: None,
            compaction: None,
            error: None,
        };
        match result {
            Ok(c) => {
                a.result = "applied";
                a.tokens_before = Some(c.tokens_before);
                a.tokens_after = Some(c.tokens_after);
                a.rung = Some(c.rung.as_str());
                a.compaction = Some(c.id.clone());
            }
            Err(CompactError::NoShrink { before, after }) => {
                a.result = "discarded";
                a.tokens_before = Some(*before);
                a.tokens_after = Some(*after);
            }
            Err(e) => a.error = Some(e.to_string()),
        }
        a
    }
}

/// The recent attempts of the recent conversations, by (tenant,
/// conversation), oldest first: discarded ones leave no compaction to
/// show. One lock.
pub(super) struct Attempts {
    kept: Mutex<Generations<(String, String), Vec<Attempt>>>,
}

impl Default for Attempts {
    fn default() -> Self {
        Self {
            kept: Mutex::new(Generations::new(ATTEMPT_CONVERSATIONS)),
        }
    }
}

impl Attempts {
    /// Keeps an attempt of the conversation `key` (the latest
    /// [`ATTEMPTS_KEPT`]).
    pub(super) fn push(&self, key: (String, String), attempt: Attempt) {
        let mut kept = lock(&self.kept);
        let mut list = kept.renew(&key).cloned().unwrap_or_default();
        list.push(attempt);
        if list.len() > ATTEMPTS_KEPT {
            list.remove(0);
        }
        kept.insert(key, list);
    }

    /// The conversation's recent attempts, oldest first.
    pub(super) fn of(&self, tenant: &str, conversation: &str) -> Vec<Attempt> {
        let key = (tenant.to_string(), conversation.to_string());
        lock(&self.kept).get(&key).cloned().unwrap_or_default()
    }
}

/// Attempts kept per conversation, the latest.
pub(super) const ATTEMPTS_KEPT: usize = 32;

/// Conversations whose attempts are kept, per generation.
pub(super) const ATTEMPT_CONVERSATIONS: usize = 4096;
