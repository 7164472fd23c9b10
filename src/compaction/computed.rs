//! A computed compaction, as stored and applied ([`Compaction`]): what it
//! covers and puts in its place, the rung that made it ([`Rung`]) and its
//! figures, among them its summary calls' prompt-cache use
//! ([`SummaryCache`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::replacement;
use super::summary::{self, Facts};
use crate::wire::ItemHash;

/// Which rung of the ladder produced a compaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rung {
    /// Oversized tool outputs truncated (head and tail kept).
    Truncate,
    /// Old tool outputs replaced by stubs.
    Prune,
    /// A model-written structured summary with extracted facts.
    Summary,
    /// The summary model failed twice: extracted facts only.
    Fallback,
    /// The client's own summary (it compacted by itself), kept as it came,
    /// with what it left out of the trail appended.
    Handoff,
}

impl Rung {
    /// Name used in records, logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Rung::Truncate => "truncate",
            Rung::Prune => "prune",
            Rung::Summary => "summary",
            Rung::Fallback => "fallback",
            Rung::Handoff => "handoff",
        }
    }

    /// Parses [`Rung::as_str`].
    pub fn parse(s: &str) -> Option<Rung> {
        [
            Rung::Truncate,
            Rung::Prune,
            Rung::Summary,
            Rung::Fallback,
            Rung::Handoff,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

/// A computed compaction, as stored and applied.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Compaction {
    /// `cmp_…`
    pub id: String,
    /// Tenant it belongs to; never applied to another.
    pub tenant: String,
    /// Conversation it was computed for.
    pub conversation: String,
    /// Number of leading original items it replaces.
    pub covered_len: usize,
    /// Chain hash of those items.
    pub covered_chain: ItemHash,
    /// What is sent in their place.
    pub replacement: Vec<Value>,
    /// Rung used.
    pub rung: Rung,
    /// Why it ran (threshold figures, overflow, manual).
    pub reason: String,
    /// Estimated tokens of the request before.
    pub tokens_before: u64,
    /// Estimated tokens of the request after.
    pub tokens_after: u64,
    /// Items of the view that were compacted away.
    pub items_removed: usize,
    /// Items of the view kept verbatim (leading, recent users, tail).
    pub items_kept: usize,
    /// The summary text, for summary rungs.
    pub summary: Option<String>,
    /// Extracted facts, carried into the next compaction.
    pub facts: Option<Facts>,
    /// The compaction this one extends, if any.
    pub base: Option<String>,
    /// Summarizer calls made.
    pub summary_calls: u32,
    /// Tokens of those calls, prompt and answer.
    #[serde(default)]
    pub summary_tokens: u64,
    /// Of `summary_tokens`, those the summarizer wrote (priced as output).
    #[serde(default)]
    pub summary_output_tokens: u64,
    /// What those calls' prompts read from and wrote to the upstream's
    /// prompt cache, as it reported them (priced at the cache's rates).
    #[serde(default)]
    pub summary_cache: SummaryCache,
    /// Estimated tokens fewer than the client's own items it covers: its
    /// own shrink plus that of the compaction it extends (whose
    /// replacement it started from). What a request it applies to saves.
    #[serde(default)]
    pub tokens_saved: u64,
    /// Computed in observe mode: what the proxy would have sent, recorded
    /// for the potential savings and never applied to a request.
    #[serde(default)]
    pub observed: bool,
    /// Its facts checklist and what it removed (none for one stored
    /// before audits were kept).
    #[serde(default)]
    pub audit: Option<summary::Audit>,
    /// Wall time to compute, ms.
    pub duration_ms: u64,
    /// Unix ms.
    pub created_ms: i64,
    /// The replacement's hashes and JSON, made on first use.
    #[serde(skip)]
    pub made: replacement::Made,
}

/// The prompt-cache figures of a compaction's summary calls, summed over
/// the calls, as their upstream reported them: 0 where it reported none
/// (an older server, or no call), which prices that prompt uncached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SummaryCache {
    /// Prompt tokens read from the cache.
    pub read: u64,
    /// Prompt tokens written to it.
    pub write: u64,
    /// Of `write`, those written for an hour.
    pub write_1h: u64,
}

impl SummaryCache {
    /// Adds what one call's `usage` reported.
    pub fn add(&mut self, usage: &crate::wire::Usage) {
        self.read += usage.cached_tokens.unwrap_or(0);
        self.write += usage.cache_write_tokens.unwrap_or(0);
        self.write_1h += usage.cache_write_1h_tokens.unwrap_or(0);
    }
}

/// A compaction's replacement, for a request's items to share
/// ([`crate::wire::items::ItemList::with_prefix_shared`]).
impl AsRef<[Value]> for Compaction {
    fn as_ref(&self) -> &[Value] {
        &self.replacement
    }
}

/// Whether the first `len` items of a request whose chain hashes are
/// `chains` are those whose chain hash is `chain`.
pub fn covers_prefix(chains: &[ItemHash], len: usize, chain: &ItemHash) -> bool {
    chains.get(len.wrapping_sub(1)) == Some(chain)
}

impl Compaction {
    /// Whether it stands for a prefix of a request whose chain hashes are
    /// `chains`.
    pub fn covers(&self, chains: &[ItemHash]) -> bool {
        covers_prefix(chains, self.covered_len, &self.covered_chain)
    }

    /// A compaction made now under a fresh id that no summary call paid
    /// for: `replacement` standing for the first `covered_len` items of
    /// `tenant`'s `conversation` (prefix chain `covered_chain`), every
    /// figure zero and nothing beside it, for the maker to fill in what it
    /// knows.
    pub fn made_now(
        tenant: &str,
        conversation: &str,
        (covered_len, covered_chain): (usize, ItemHash),
        replacement: Vec<Value>,
        rung: Rung,
        reason: String,
    ) -> Compaction {
        Compaction {
            id: crate::ids::new_compaction_id(),
            tenant: tenant.into(),
            conversation: conversation.into(),
            covered_len,
            covered_chain,
            replacement,
            rung,
            reason,
            tokens_before: 0,
            tokens_after: 0,
            items_removed: 0,
            items_kept: 0,
            summary: None,
            facts: None,
            base: None,
            summary_calls: 0,
            summary_tokens: 0,
            summary_output_tokens: 0,
            summary_cache: Default::default(),
            tokens_saved: 0,
            observed: false,
            audit: None,
            duration_ms: 0,
            created_ms: crate::ids::now_ms(),
            made: Default::default(),
        }
    }

    /// The canonical hashes of the replacement's items.
    pub fn replacement_hashes(&self) -> &std::sync::Arc<Vec<ItemHash>> {
        self.made.hashes(&self.replacement)
    }

    /// The replacement's items as JSON for an `api` body's item array,
    /// comma-separated, a comma after the last when items `follow` (see
    /// [`replacement::Made::array_json`]).
    pub fn replacement_json(&self, api: crate::wire::Api, follow: bool) -> bytes::Bytes {
        self.made.array_json(api, &self.replacement, follow)
    }

    /// Estimated tokens fewer than the client's own items it covers (one
    /// stored before the figure was kept: its own shrink).
    pub fn saved(&self) -> u64 {
        if self.tokens_saved > 0 {
            self.tokens_saved
        } else {
            self.tokens_before.saturating_sub(self.tokens_after)
        }
    }
}

/// A summary compaction for unit tests: `id` of `tenant`, replacing the
/// first `covered_len` items (chain hash `covered_chain`) with `replacement`.
#[cfg(test)]
pub(crate) fn test_compaction(
    id: &str,
    tenant: &str,
    covered_len: usize,
    covered_chain: ItemHash,
    replacement: Vec<Value>,
) -> Compaction {
    Compaction {
        id: id.into(),
        tenant: tenant.into(),
        conversation: "c".into(),
        covered_len,
        covered_chain,
        replacement,
        rung: Rung::Summary,
        reason: "manual".into(),
        tokens_before: 100,
        tokens_after: 10,
        items_removed: covered_len.saturating_sub(2),
        items_kept: 2,
        summary: None,
        facts: None,
        base: None,
        summary_calls: 1,
        summary_tokens: 0,
        summary_output_tokens: 0,
        summary_cache: SummaryCache::default(),
        tokens_saved: 0,
        observed: false,
        audit: None,
        duration_ms: 1,
        created_ms: 1,
        made: Default::default(),
    }
}
