//! Compaction: when, where and how a conversation's history is rewritten.
//!
//! This layer decides and computes, without I/O; [`crate::engine`] does the
//! I/O around it (summary calls, storage, background jobs):
//!
//! - [`policy`]: should this conversation compact? (`decide`)
//! - [`cut`]: where is the cut? (safe cuts: tool batches atomic)
//! - [`ladder`]: the cheap rungs — truncate, then prune tool outputs
//! - [`fit`]: escalation past the ladder until a request fits a limit
//! - [`summary`]: facts the proxy extracts itself, the summarizer prompt,
//!   validation, the assembled summary and its deterministic fallback
//! - [`append`]: a later summary after the earlier ones, their bytes kept,
//!   until together they pass their budget
//! - [`rewrite`]: applying a stored compaction to a request (longest match)
//! - [`recall`]: the `compactor_recall` tool that reads back what the cheap
//!   rungs elided
//! - [`provider`]: the summary rung's output when the provider compacts
//! - [`agent_tool`]: the `compactor_compact` tool with which the model asks
//!   for a compaction at the next turn boundary
//! - [`remote`]: compaction the client asks for (`/v1/responses/compact`,
//!   `compaction_trigger`) and the `compaction` items that stand for it
//! - [`boundary`]: the provider's own compaction a client asks for, and the
//!   newest provider compaction item, before which nothing is compacted
//! - [`rebuild`]: a provider compaction item the provider refuses, and the
//!   history from the record that takes its place
//! - [`replacement`]: the replacement's hashes and JSON, made once for all
//!   the requests it applies to
//!
//! A compaction replaces the first `covered_len` items the client sends —
//! identified by their chain hash, so it can never apply to bytes it did not
//! cover — with `replacement`: the leading system items verbatim, then either
//! the older items with tool outputs truncated or pruned, or one summary
//! message plus the most recent user messages verbatim. Compacting again
//! works on the rewritten view: a new summary goes after the earlier
//! compaction's replacement, kept as it was sent, and covers the newer
//! items; once the summaries together pass their budget, one covers
//! [previous summaries + newer items] ([`append`]). Never the raw history
//! again.
//!
//! This file only declares the children and hands their names on: what
//! they share is a child of its own (the [`Compaction`] and its [`Rung`] in
//! `computed`, the budgets in `params`, the cut a compaction starts from in
//! `prepare`, the rungs' replacements in `rungs`), which they name.

pub mod agent_tool;
pub mod append;
pub mod boundary;
mod computed;
pub mod cut;
pub mod fit;
pub mod items;
pub mod ladder;
mod params;
pub mod policy;
mod prepare;
pub mod provider;
pub mod rebuild;
pub mod recall;
pub mod remote;
pub mod replacement;
pub mod rewrite;
mod rungs;
pub mod summary;

#[cfg(test)]
pub(crate) use computed::test_compaction;
pub use computed::{covers_prefix, Compaction, Rung, SummaryCache};
pub use params::{Params, HYSTERESIS, SUMMARIES_BUDGET, SUMMARY_MAX_BYTES};
pub use prepare::{prepare, prepare_whole, Prepared};
pub use rungs::{cheap_rungs, summary_replacement};
