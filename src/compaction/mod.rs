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

pub mod agent_tool;
pub mod append;
pub mod boundary;
pub mod cut;
pub mod fit;
pub mod items;
pub mod ladder;
pub mod policy;
pub mod provider;
pub mod rebuild;
pub mod recall;
pub mod remote;
pub mod replacement;
pub mod rewrite;
pub mod summary;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{CompactionConfig, ModelLimits};
use crate::wire::ItemHash;
use ladder::TruncateLimits;
use summary::Facts;

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

impl Compaction {
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

/// Budgets for one compaction, derived from the config and the model.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Tokens of verbatim tail to keep.
    pub tail_budget: u64,
    /// Tokens of verbatim user messages kept from the compacted part.
    pub recent_user_budget: u64,
    /// The request should end up at or under this many tokens.
    pub target_tokens: u64,
    /// Rung 1 limits.
    pub truncate: TruncateLimits,
    /// Largest summary message, bytes.
    pub summary_max_bytes: usize,
    /// Largest the summaries of one request may be together, bytes: a
    /// later summary is appended after the earlier ones while they stay
    /// within it, else they are rewritten into one ([`append`]).
    pub summaries_max_bytes: usize,
    /// Largest answer asked of the summarizer, tokens.
    pub summary_output_tokens: u64,
    /// Largest transcript chunk per summarizer call, tokens.
    pub summary_chunk_tokens: u64,
}

/// Hysteresis: a compaction's cheap rungs must bring the request to at
/// most this share of the trigger ([`policy::trigger_tokens`]), so that
/// one compaction buys at least as many tokens of turns as it leaves
/// rather than a prune that lands just under the trigger and is due again
/// a turn later.
pub const HYSTERESIS: f64 = 0.5;

/// Largest summary message, bytes, on a large window: about 6k tokens, so
/// that a compacted conversation restarts small (its summary, the
/// proxy's facts, the newest turn), as a client's own compaction does.
pub const SUMMARY_MAX_BYTES: usize = 24_000;

/// The summaries of one request together, in summary budgets: a later
/// summary is appended while the earlier ones and it fit (see [`append`]).
/// Two: one summary appended, then a rewrite. Measured on the economics
/// bench's Claude-Code-shaped sessions, the bill is the same as rewriting
/// every time ($7.58 against $7.58, three seeds) with later compactions
/// reading 68–74% of their first prompt from the cache instead of 51–61%
/// and a few more facts kept; three budgets cost 2% more (every later
/// request reads the summaries kept, at 0.1× each).
pub const SUMMARIES_BUDGET: usize = 2;

impl Params {
    /// Budgets for `limits`, scaled down for small windows so a compacted
    /// request always has room left.
    pub fn new(cfg: &CompactionConfig, limits: &ModelLimits) -> Params {
        let w = limits.context_window;
        let frac = |f: f64| (w as f64 * f) as u64;
        let summary_output_tokens = frac(0.12).clamp(128, 4096);
        let summary_max_bytes = (frac(0.15) * 4).clamp(1024, SUMMARY_MAX_BYTES as u64) as usize;
        let hysteresis = (policy::trigger_tokens(limits) as f64 * HYSTERESIS) as u64;
        Params {
            tail_budget: cfg.tail_tokens.min(frac(0.2)),
            recent_user_budget: cfg.recent_user_tokens.min(frac(0.1)),
            target_tokens: frac(cfg.target_ratio).min(hysteresis),
            truncate: TruncateLimits {
                max_bytes: cfg.tool_output_max_bytes,
                keep_head: cfg.tool_output_keep_bytes * 2 / 3,
                keep_tail: cfg.tool_output_keep_bytes / 3,
            },
            summary_max_bytes,
            summaries_max_bytes: summary_max_bytes * SUMMARIES_BUDGET,
            summary_output_tokens,
            // Room for the prompt, the previous summary and the answer.
            summary_chunk_tokens: w.saturating_sub(summary_output_tokens * 3 + 400).max(256),
        }
    }
}

/// The cut and figures a compaction starts from.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Cut in the view.
    pub cut: usize,
    /// Cut in the original items (what the compaction covers).
    pub covered_len: usize,
    /// Leading system items.
    pub lead: usize,
    /// Tokens of the whole view.
    pub before: u64,
    /// Tokens of the view's tail (from the cut on).
    pub tail: u64,
}

/// Chooses the cut for `view` (the request as it would go upstream, after
/// `base` if one applied). `None` when there is nothing safe to compact.
pub fn prepare(
    view: &[Value],
    tokens: &[u64],
    base: Option<&Compaction>,
    params: &Params,
) -> Option<Prepared> {
    // A cut inside the base's replacement could not be mapped back to the
    // client's items: the previous summary is compacted with what follows.
    let min_cut = base.map(|b| b.replacement.len()).unwrap_or(0);
    let cut = cut::choose_cut(view, tokens, params.tail_budget)?.max(min_cut);
    finish_prepare(view, tokens, base, cut, false)
}

/// Like [`prepare`], but compacts everything after the leading items that
/// can be compacted safely: an explicit compaction request
/// (`/v1/responses/compact`, `compaction_trigger`) keeps no verbatim tail.
pub fn prepare_whole(
    view: &[Value],
    tokens: &[u64],
    base: Option<&Compaction>,
) -> Option<Prepared> {
    let min_cut = base.map(|b| b.replacement.len()).unwrap_or(0);
    finish_prepare(view, tokens, base, min_cut, true)
}

fn finish_prepare(
    view: &[Value],
    tokens: &[u64],
    base: Option<&Compaction>,
    from: usize,
    whole: bool,
) -> Option<Prepared> {
    let safe = cut::safe_cuts(view);
    // Everything up to the provider's newest compaction item goes as sent.
    let lead = items::leading_system(view).max(boundary::safe_floor(view, &safe));
    let ok = |i: &usize| safe[*i] && *i > lead;
    let cut = if whole {
        (from..=view.len()).rev().find(ok)?
    } else {
        // Moving the cut forward past the replacement must land on a safe cut too.
        (from..view.len()).find(ok)?
    };
    let covered_len = rewrite::view_to_original(cut, base)?;
    Some(Prepared {
        cut,
        covered_len,
        lead,
        before: tokens.iter().sum(),
        tail: tokens[cut..].iter().sum(),
    })
}

/// Rungs 1 and 2 on `view[..cut]`: the first whose result fits the target,
/// as (rung, replacement, tokens after).
pub fn cheap_rungs(
    view: &[Value],
    hashes: &[ItemHash],
    p: &Prepared,
    params: &Params,
    count: &dyn Fn(&Value) -> u64,
) -> Option<(Rung, Vec<Value>, u64)> {
    // The leading items (and a provider compaction item with what precedes
    // it) are kept as they are; only what follows them is rewritten.
    let kept = &view[..p.lead];
    let part = &view[p.lead..p.cut];
    let hashes = &hashes[p.lead..p.cut];
    let whole =
        |rewritten: &[Value]| -> Vec<Value> { kept.iter().chain(rewritten).cloned().collect() };
    let kept_tokens = boundary::seen_tokens(kept, count);
    let (truncated, n1) = ladder::truncate_outputs(part, hashes, params.truncate);
    let after1: u64 = kept_tokens + truncated.iter().map(count).sum::<u64>() + p.tail;
    if n1 > 0 && after1 <= params.target_tokens {
        return Some((Rung::Truncate, whole(&truncated), after1));
    }
    let (pruned, n2) = ladder::prune_outputs(&truncated, hashes);
    let after2: u64 = kept_tokens + pruned.iter().map(count).sum::<u64>() + p.tail;
    if n1 + n2 > 0 && after2 <= params.target_tokens {
        return Some((Rung::Prune, whole(&pruned), after2));
    }
    None
}

/// Rung 3's replacement: leading items, the summary message, and, in their
/// order, the system messages and the recent user messages of the compacted
/// part (the latest user message always, when it is there; see
/// [`cut::kept_verbatim`]). Returns (replacement, tokens after, messages
/// kept verbatim after the summary).
pub fn summary_replacement(
    view: &[Value],
    tokens: &[u64],
    p: &Prepared,
    params: &Params,
    summary_text: String,
    count: &dyn Fn(&Value) -> u64,
) -> (Vec<Value>, u64, usize) {
    let part = &view[p.lead..p.cut];
    let part_tokens = &tokens[p.lead..p.cut];
    // The latest user message of the whole view must reach the model verbatim.
    let newest_is_here = items::latest_user(view).is_some_and(|i| i >= p.lead && i < p.cut);
    let recent = cut::kept_verbatim(part, part_tokens, params.recent_user_budget, newest_is_here);
    let media: Vec<String> = part
        .iter()
        .enumerate()
        .filter(|(i, _)| !recent.contains(i))
        .flat_map(|(_, item)| items::media_markers(item))
        .collect();
    let mut replacement: Vec<Value> = view[..p.lead].to_vec();
    replacement.push(items::user_message(with_media_note(summary_text, &media)));
    replacement.extend(recent.iter().map(|&i| part[i].clone()));
    let after = boundary::seen_tokens(&replacement, count) + p.tail;
    (replacement, after, recent.len())
}

/// Most media markers a summary lists; past them, how many more.
const MAX_MEDIA_MARKERS: usize = 16;

/// `summary` with a line for each image, document or audio block of the
/// items it replaced: the model learns what it was shown is gone, and can
/// ask for it again.
fn with_media_note(mut summary: String, markers: &[String]) -> String {
    if markers.is_empty() {
        return summary;
    }
    summary.push_str(
        "\n\n## MEDIA NOT KEPT\nRecorded by the proxy: what the replaced messages showed, which \
         this summary cannot carry (ask for it again if it is still needed)",
    );
    for m in markers.iter().take(MAX_MEDIA_MARKERS) {
        summary.push_str("\n- ");
        summary.push_str(m);
    }
    if markers.len() > MAX_MEDIA_MARKERS {
        summary.push_str(&format!(
            "\n- and {} more",
            markers.len() - MAX_MEDIA_MARKERS
        ));
    }
    summary
}

#[cfg(test)]
mod params_tests {
    use super::*;

    #[test]
    fn the_target_leaves_half_the_trigger_to_grow_into() {
        let cfg = CompactionConfig {
            target_ratio: 0.6,
            trigger_ratio: 0.75,
            ..CompactionConfig::default()
        };
        let limits = ModelLimits {
            context_window: 200_000,
            max_output_tokens: 32_000,
            trigger_ratio: 0.75,
            trigger_max_tokens: 0,
        };
        // 0.6 of the window would be 120k, just under the 126k trigger: a
        // prune landing there would be due again a turn later.
        let p = Params::new(&cfg, &limits);
        assert_eq!(p.target_tokens, 63_000);
        // The defaults restart small on Claude's window.
        let p = Params::new(&CompactionConfig::default(), &limits);
        assert_eq!(p.target_tokens, 30_000);
        assert!(p.tail_budget + p.recent_user_budget <= 8_000);
        assert_eq!(p.summary_max_bytes, SUMMARY_MAX_BYTES);
    }
}
